"""`tutti-hicache`: demo, bench store, inspect, fsck.

    tutti-hicache demo [--dir DIR] [--geometry small] [--pages 256]
    tutti-hicache bench store --medium DIR [--geometry llama3-8b] [--pages N] [--json OUT]
    tutti-hicache inspect DIR [DIR ...]
    tutti-hicache fsck DIR [DIR ...] [--repair]
    tutti-hicache profile --out slack.json [--read-gbps R --write-gbps W]
    tutti-hicache cost [--from-json prefill.json | --throughput T --dram-gb M --ssd-gb S]
                       [--stats STATS.json] [--ssd-dwpd 1 --ssd-warranty-years 5 ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile

from . import __version__
from .testing.sglang import INSTALL_HINT  # imports neither SGLang nor torch


def _bench_spec(a):
    from .benchmarks.store import BenchSpec
    return BenchSpec(medium=a.medium, geometry=a.geometry, pages=a.pages, layout=a.layout,
                     engine=a.engine, queue_depth=a.queue_depth,
                     threads=a.threads, with_file=not a.no_file, keep=False, seed=a.seed,
                     pin_memory=a.pin)


def cmd_bench_store(a) -> int:
    from .benchmarks.store import run, table
    try:
        res = run(_bench_spec(a))
    except ValueError as e:  # a spec this machine cannot run (nothing written)
        print(f"tutti-hicache bench store: {e}", file=sys.stderr)
        return 2
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"\nJSON written to {a.json}")
    ok = res["tutti_verified_bytes_equal"] and res["tutti_noverify_verified_bytes_equal"]
    return 0 if ok else 1


def cmd_demo(a) -> int:
    from .benchmarks.store import beyond_raw, run, table
    from .testing.sglang import ensure_sglang
    ensure_sglang()  # before anything is printed or made: a clear line when SGLang is missing
    base = a.dir or tempfile.mkdtemp(prefix="tutti-demo-", dir=_default_demo_dir())
    a.medium = base
    print(f"tutti demo: {a.pages} pages of a '{a.geometry}' model under {base}\n"
          "  1. write the pages through TuttiStorage (SGLang's own _page_backup)\n"
          "  2. close the store, reopen it (index rebuilt from slot headers)\n"
          "  3. restore every page through SGLang's _page_transfer, compare every byte\n"
          "  4. the same with SGLang's built-in `file` backend, and a raw O_DIRECT read\n",
          flush=True)
    try:
        res = run(_bench_spec(a))
    finally:
        if not a.dir:  # the benchmark removes what it wrote; the directory we made goes too
            shutil.rmtree(base, ignore_errors=True)
    print(table(res))
    why = beyond_raw(res)
    if why:
        print("\n" + why)
    good = res["tutti_verified_bytes_equal"] and res["tutti_noverify_verified_bytes_equal"]
    print("\nall restored bytes verified" if good else "\nRESTORED BYTES DIFFER")
    return 0 if good else 1


def _default_demo_dir() -> str:
    here = os.getcwd()
    return here if os.access(here, os.W_OK) else tempfile.gettempdir()


MIN_HISTORY_S = 3600  # inspect projects wear only from at least this much counting


def _wear_lines(dirs: list, counters: list, drive_gb: float, drives: dict) -> list[str]:
    """Inspect's wear lines of one namespace; adds each directory's drive writes per day to its
    drive's entry in drives (keyed by filesystem: several directories and namespaces share a
    drive, whose figure is their sum). No projection from under MIN_HISTORY_S."""
    from .store.wear import drive_capacity, drive_key, lifetime
    out = ["  wear (bytes handed to each drive since counting began):"]
    for d, c in zip(dirs, counters):
        if c is None or "error" in c:
            out.append(f"    {d}: " + ("no counters yet" if c is None else f"damaged: {c['error']}"))
            continue
        cap = drive_capacity(d, drive_gb)
        v = lifetime(c, cap)
        wa = v["write_amplification"]
        out.append(f"    {d}: payload {v['payload_bytes']} B, header {v['header_bytes']} B, "
                   f"tombstone {v['tombstone_bytes']} B, meta {v['meta_bytes']} B = "
                   f"{v['physical_bytes'] / 1e9:.3f} GB for {v['logical_bytes'] / 1e9:.3f} GB of "
                   f"KV, write amplification {f'{wa:.4f}' if wa else 'n/a'}")
        if v["seconds"] < MIN_HISTORY_S:
            out.append(f"      over {v['seconds'] / 60:.1f} min: too little history to project "
                       f"drive writes per day or a lifetime (needs {MIN_HISTORY_S // 3600} h of "
                       "counting)")
            continue
        drive = drives.setdefault(drive_key(d), {"dirs": [], "dwpd": 0.0, "capacity": cap})
        drive["dirs"] += [d] if d not in drive["dirs"] else []
        drive["dwpd"] += v["drive_writes_per_day"]
        out.append(f"      over {v['seconds'] / 86400:.2f} days: {v['drive_writes_per_day']:.4g} "
                   f"drive writes per day of {cap / 1e12:.3f} TB from this directory (its "
                   f"drive's total, with every directory on it, is below)")
    return out


def _drive_lines(drives: dict) -> list[str]:
    """One line per drive: the drive writes per day of every directory and namespace on it, and
    how long a drive's rating lasts at that rate."""
    from .cost import Endurance
    rating = Endurance()
    out = []
    for drive in sorted(drives.values(), key=lambda x: sorted(x["dirs"])):
        years = rating.years_at(drive["dwpd"])
        out.append(f"drive {', '.join(sorted(drive['dirs']))}: {drive['dwpd']:.4g} drive writes "
                   f"per day of {drive['capacity'] / 1e12:.3f} TB, all namespaces"
                   + (f"; a {rating.dwpd:g} DWPD x {rating.warranty_years:g} y rating lasts "
                      f"{years:.3g} years at this rate" if years else ""))
    return out


def _stores(a) -> dict:
    """{namespace: dirs} under a.dirs; ValueError for a missing directory or no store at all."""
    from .store.repair.fsck import namespaces, quarantined
    # spelled as a server's tutti_dirs are: fsck --repair takes attach's lock, at min(dirs)
    a.dirs = [os.path.abspath(d) for d in a.dirs]
    for d in a.dirs:
        if not os.path.isdir(d):
            raise ValueError(f"{d}: no such directory (give the store directories, tutti_dirs)")
    found = namespaces(a.dirs)
    if not found and not quarantined(a.dirs):
        raise ValueError(f"no tutti store in {', '.join(a.dirs)} (a store directory holds "
                         "tutti-<fingerprint> namespaces; give the server's tutti_dirs)")
    return found


def cmd_inspect(a) -> int:
    from .store.repair.fsck import ExistingNamespace, quarantined
    found = _stores(a)
    failed = 0
    for line in quarantined(a.dirs):
        print(line)
    drives: dict = {}
    for name, dirs in found.items():
        try:
            store = ExistingNamespace(dirs, name, given=a.dirs)
        except (ValueError, OSError) as e:
            print(f"{name}: cannot open: {e}")
            failed += 1
            continue
        try:
            slots, nbytes = store.capacity_slots, store.layout.slot_nbytes
            print(f"{name}  ({', '.join(store.dirs)})")
            print(f"  identity: {json.dumps(store.identity, sort_keys=True)}")
            print(f"  slots: {slots} x {nbytes} B = {slots * nbytes / 2**30:.2f} GiB "
                  f"(the segment files' sizes), pages: {len(store)}")
            for line in store.notes:
                print(f"  metadata: {line}")
            for line in store.issues:
                print(f"  segments: {line}")
            entries = store.entries()
            for k in sorted(entries)[: a.keys]:
                e = entries[k]
                print(f"    {k}  slot {e.slot}  seq {e.seq}  xxh3 {e.checksum:016x}")
            print("\n".join(_wear_lines(store.dirs, store.wear(), a.drive_capacity_gb, drives)))
        finally:
            store.close()
    for line in _drive_lines(drives):
        print(line)
    return 1 if failed else 0


def _repaired(n: int, done: int, what: str, verb: str, repair: bool) -> str:
    """ "3 bad payloads", with --repair "3 bad payloads dropped" only when all 3 were, else
    "3 bad payloads (1 dropped, 2 not repaired)" / "(not repaired)"."""
    if not repair or not n:
        return f"{n} {what}"
    if done == n:
        return f"{n} {what} {verb}"
    return f"{n} {what} ({done} {verb}, {n - done} not repaired)" if done else \
        f"{n} {what} (not repaired)"


def cmd_fsck(a) -> int:
    """Exit 0 only when every namespace was checked and nothing is left wrong: with --repair,
    when every bad page was dropped and every unreadable header cleared."""
    from .store.repair.fsck import ExistingNamespace, quarantined
    found = _stores(a)
    left = 0  # findings not repaired, and namespaces not checked
    for line in quarantined(a.dirs):  # set aside by attach: no longer served, not damage now
        print(line)
    for name, dirs in found.items():
        try:
            store = ExistingNamespace(dirs, name, writer=a.repair, given=a.dirs)
        except (ValueError, OSError) as e:
            print(f"{name}: cannot check: {e}")
            left += 1
            continue
        healed: list[str] = []
        failed: list[str] = []
        try:
            r = store.check(repair=a.repair, progress=sys.stderr.isatty())
            if a.repair and not r["refused"] and (r["notes"] or r["issues"]):
                healed, failed, r["notes"], r["issues"] = store.heal()  # what attach would heal
                r["not_repaired"] += failed
        finally:
            store.close()
        left += (r["bad"] - r["dropped"] + r["bad_headers"] - r["cleared"] + r["foreign_headers"]
                 + len(r["issues"]) + len(r["notes"]) + len(failed))
        pages = _repaired(r["bad"], r["dropped"], "bad payloads", "dropped", a.repair)
        heads = _repaired(r["bad_headers"], r["cleared"], "unreadable headers", "cleared", a.repair)
        print(f"{name}: {r['checked']} pages checked, {pages}, {heads}"
              + (f", {r['foreign_headers']} headers of another slot or namespace"
                 if r["foreign_headers"] else ""))
        if r["live_writers"]:
            print(f"  live: {r['live_writers']} writer process(es) registered: pages they "
                  f"rewrite during the check are read again, not reported"
                  + ("; rows they hold cannot be repaired" if a.repair else ""))
        if r["changed"]:
            print(f"  {r['changed']} pages or headers changed while checked (a live writer "
                  f"rewrote their slots): not damage")
        if r["refused"] and not a.repair:
            print(f"  --repair would refuse: {r['refused']}")
        for why in r["not_repaired"]:
            print(f"  not repaired: {why}")
        for line in healed:
            print(f"  healed: {line}")
        for line in r["notes"]:
            print(f"  metadata: {line}")
        for line in r["issues"]:
            print(f"  segments: {line}")
        for k in r["bad_keys"]:
            print(f"  bad: {k}")
    return 1 if left else 0


def cmd_profile(a) -> int:
    import json as _json
    import torch
    from . import profiler
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {a.device}: no CUDA device here; profile on the GPU the "
                         "server runs on (--device cpu --quick checks the pipeline)")
    shape = dict(profiler.LLAMA3_8B)
    if a.quick:
        shape.update(hidden=256, heads=4, kv_heads=2, head_dim=64, mlp=512)
    table, seconds, samples = profiler.profile(shape, a.device, a.read_gbps * 1e9,
                                               a.write_gbps * 1e9, quick=a.quick)
    table.sm_budget = a.io_sms
    table.save(a.out)
    print(f"profiled {len(samples)} (input, prefix) points in {seconds:.1f} s on {a.device}")
    print(f"per-layer model: t = {table.model.a:.3g} + {table.model.b:.3g}*n + {table.model.c:.3g}*n*(p+n/2) s; "
          f"max relative error {profiler.relative_error(table.model, samples):.1%}")
    print(f"slack table ({len(table.rows)} buckets) written to {a.out}")
    if a.verbose:
        print(_json.dumps(table.rows))
    return 0


def _endurance(a):
    from .cost import Endurance
    return Endurance(a.ssd_dwpd, a.ssd_warranty_years, a.ssd_drive_usd, a.ssd_drive_tb)


def _json_file(path: str, flag: str):
    """A JSON file the user named; ValueError naming the flag and the file otherwise."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"{flag} {path}: not JSON ({e})") from None


def _is_number(v, low: float = 0.0) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low


def _stats_wear(stats, path: str) -> None:
    """ValueError unless stats is a tutti_stats_file with the wear counters cost needs."""
    w = stats.get("wear") if isinstance(stats, dict) else None
    wa = w.get("write_amplification") if isinstance(w, dict) else None
    if not isinstance(w, dict) or not all(_is_number(w.get(k)) for k in
                                          ("seconds", "physical_bytes")) or \
            not (wa is None or _is_number(wa)):
        raise ValueError(f"--stats {path}: not a tutti_stats_file (it needs the store's wear "
                         f"counters: an object with \"wear\": {{\"seconds\", \"physical_bytes\", "
                         f"\"write_amplification\"}}, as tutti_stats_file writes them)")


def _prefill_rows(a, endurance, prices, wa) -> list:
    """cost.prefill_rows of the --from-json file; ValueError when it is not a bench_prefill
    result (naming what is missing or wrong)."""
    from . import cost
    result = _json_file(a.from_json, "--from-json")
    what = "a JSON object" if not isinstance(result, dict) else \
        "its \"shape\"" if not isinstance(result.get("shape"), dict) else \
        "its \"results\" list" if not isinstance(result.get("results"), list) else None
    if what is None:
        try:
            return cost.prefill_rows(result, endurance, a.sessions, a.gpus, prices, wa)
        except KeyError as e:
            what = f"a {e} field"
        except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
            what = f"usable numbers ({e})"
    raise ValueError(f"--from-json {a.from_json}: not a bench_prefill result (it lacks {what})")


def cmd_cost(a) -> int:
    from . import cost
    if not a.from_json and a.throughput is None:
        raise ValueError("give the measured throughput, --throughput TOKENS_PER_S, or a "
                         "bench_prefill result, --from-json FILE: the cost per token is the "
                         "machine's price divided by it")
    if not a.from_json and a.write_amplification is not None:
        raise ValueError("--write-amplification scales the KV a --from-json run writes; with "
                         "--throughput the bytes written are the drive's own (--stats measures "
                         "them, amplification included; --write-gb-per-mtok gives them): leave "
                         "it out")
    endurance = _endurance(a)
    rate, wa, measured_wa = 0.0, a.write_amplification, None
    if a.stats:  # every file is read and checked before anything is printed
        stats = _json_file(a.stats, "--stats")
        _stats_wear(stats, a.stats)
        rate, measured_wa = cost.measured_rate(stats)
        wa = wa or measured_wa
    prices = (a.p_gpu, a.p_mem, a.p_ssd)
    if a.from_json:
        rows = _prefill_rows(a, endurance, prices, wa)
    else:
        written = (a.write_gb_per_mtok * 1e9 if a.write_gb_per_mtok is not None
                   else rate / a.throughput * 1e6)
        rows = [cost.CostRow("given", 0, 0, a.throughput, cost.cost_per_million(
            a.throughput, a.gpus, a.dram_gb, a.ssd_gb, *prices), written,
            endurance.per_million(written))]
    if a.stats:
        print(f"measured ({a.stats}): {rate / 1e6:.1f} MB/s written, write amplification "
              f"{f'{measured_wa:.4f}' if measured_wa else 'n/a'}")
    print(f"assumed: ${a.p_gpu:g}/h per GPU (--p-gpu) x {a.gpus:g} GPU(s) (--gpus), "
          f"${a.p_mem:g}/GB-h DRAM (--p-mem), ${a.p_ssd:g}/GB-h SSD (--p-ssd)"
          + ("" if a.from_json else f", {a.dram_gb:g} GB DRAM (--dram-gb), {a.ssd_gb:g} GB SSD "
             f"(--ssd-gb)"))
    if not a.from_json and not a.stats and a.write_gb_per_mtok is None:
        print("no write data given (--stats STATS.json or --write-gb-per-mtok GB): the SSD "
              "wear is not included (wear $/1M shows 0)")
    elif not a.from_json and a.write_gb_per_mtok is None and not rate:
        print(f"--stats {a.stats}: no bytes written while it counted: the SSD wear term is 0")
    print(cost.table(rows, endurance, a.ssd_drives))
    return 0


def _add_bench_args(p, pages: int, geometry: str) -> None:
    from .benchmarks.store import GEOMETRIES
    from .config import SETTINGS
    default = {s.name: s for s in SETTINGS}
    p.add_argument("--geometry", default=geometry, choices=sorted(GEOMETRIES),
                   help="model shape of the KV pages (layers, heads, page of 64 tokens)")
    p.add_argument("--pages", type=_count, default=pages, help="KV pages written and restored")
    p.add_argument("--layout", default="layer_first",
                   choices=["layer_first", "page_first", "page_first_direct"],
                   help="SGLang host-pool layout (--hicache-mem-layout)")
    p.add_argument("--engine", default=default["engine"].default,  # tutti_engine's own
                   choices=list(default["engine"].choices))
    p.add_argument("--queue-depth", type=int, default=default["queue_depth"].default)
    p.add_argument("--threads", type=int, default=default["threads"].default)
    p.add_argument("--no-file", action="store_true", help="skip SGLang's file backend")
    p.add_argument("--seed", type=int, default=0, help="seed of the random page contents")
    p.add_argument("--pin", action="store_true", help="pinned host pool (needs CUDA), as in a GPU server")
    for action in p._actions:  # options that mirror a tutti_* setting carry its documentation
        if action.help is None and action.dest in default:
            action.help = f"tutti_{action.dest}: {default[action.dest].doc}".replace("%", "%%")


def _number(low: float, strict: bool = False):
    """An argparse type: a finite float >= low (> low when strict)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < low or (strict and v == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, "
                                             f"got {text}")
        return v
    return parse


def _add_wear_args(c) -> None:
    from . import cost
    c.add_argument("--stats", help="a tutti_stats_file: its measured write rate and amplification")
    c.add_argument("--write-gb-per-mtok", type=_number(0),
                   help="GB written to SSD per 1M tokens (default: from --stats and --throughput)")
    c.add_argument("--write-amplification", type=_number(1),
                   help="drive bytes per KV byte of a --from-json run (default: --stats', else "
                        "the format's)")
    c.add_argument("--ssd-dwpd", type=_number(0, True), default=cost.DEFAULT_DWPD,
                   help="rated drive writes per day")
    c.add_argument("--ssd-warranty-years", type=_number(0, True),
                   default=cost.DEFAULT_WARRANTY_YEARS, help="years the DWPD rating covers")
    c.add_argument("--ssd-drive-usd", type=_number(0), default=cost.DEFAULT_DRIVE_USD,
                   help="price of one drive ($)")
    c.add_argument("--ssd-drive-tb", type=_number(0, True), default=cost.DEFAULT_DRIVE_TB,
                   help="capacity of one drive (TB = 10^12 bytes)")
    c.add_argument("--ssd-drives", type=_number(0, True), default=1.0,
                   help="drives sharing the writes (for the DWPD column)")


def _count(text: str, least: int = 1) -> int:
    """An argparse type: an integer >= least (1)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {v}")
    return v


class _Parser(argparse.ArgumentParser):
    """Bad arguments in one line (the usage is one --help away)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="tutti-hicache", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=__version__)
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="log at INFO level, and show the traceback of an error")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="write, restart, restore and verify a long prefix")
    d.add_argument("--dir", help="where to put the store (default: a temp dir here)")
    _add_bench_args(d, 256, "small")
    d.set_defaults(fn=cmd_demo)
    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    bs = b.add_parser("store", help="L3 -> host restore vs raw O_DIRECT vs SGLang file")
    bs.add_argument("--medium", required=True, help="directory on the medium to measure")
    bs.add_argument("--json", help="write the results here")
    _add_bench_args(bs, 256, "llama3-8b")
    bs.set_defaults(fn=cmd_bench_store)
    i = sub.add_parser("inspect", help="capacity, slots, keys, identities of a store")
    i.add_argument("dirs", nargs="+", help="the store's directories (the server's tutti_dirs)")
    i.add_argument("--keys", type=lambda t: _count(t, 0), default=5,
                   help="keys to list per namespace")
    i.add_argument("--drive-capacity-gb", type=_number(0), default=0.0,
                   help="drive size for drive writes per day (GB = 10^9 B; default: statvfs)")
    i.set_defaults(fn=cmd_inspect)
    f = sub.add_parser("fsck", help="verify every slot; --repair drops bad ones")
    f.add_argument("dirs", nargs="+", help="the store's directories (the server's tutti_dirs)")
    f.add_argument("--repair", action="store_true",
                   help="tombstone the bad slots (of rows no live server holds) and heal "
                        "what a server's attach would: metadata, missing or cut segment files")
    f.set_defaults(fn=cmd_fsck)
    pr = sub.add_parser("profile", help="measure per-layer compute windows -> slack table")
    pr.add_argument("--out", required=True, help="slack table file to write (JSON)")
    pr.add_argument("--device", default="cuda", help="torch device to measure on")
    pr.add_argument("--read-gbps", type=_number(0, True), default=10.0,
                    help="store read bandwidth")
    pr.add_argument("--write-gbps", type=_number(0, True), default=2.0,
                    help="store write bandwidth")
    pr.add_argument("--io-sms", type=int, default=8,
                    help="SMs the I/O kernels use (tutti_io_sms), recorded in the table")
    pr.add_argument("--quick", action="store_true", help="tiny shapes (pipeline check)")
    pr.set_defaults(fn=cmd_profile)
    c = sub.add_parser("cost", help="$ per 1M tokens from throughput, memory sizes, SSD wear")
    c.add_argument("--from-json", help="bench_prefill JSON: one row per measured run")
    c.add_argument("--throughput", type=_number(0, True),
                   help="measured tokens/s of the configuration (required without --from-json)")
    c.add_argument("--gpus", type=_number(0, True), default=1.0, help="GPUs rented")
    c.add_argument("--dram-gb", type=_number(0), default=0.0, help="DRAM holding cached KV (GB)")
    c.add_argument("--ssd-gb", type=_number(0), default=0.0, help="SSD holding cached KV (GB)")
    c.add_argument("--sessions", type=_number(0, True), default=1.0,
                   help="cached prefixes kept (scales memory; with --from-json)")
    c.add_argument("--p-gpu", type=_number(0), default=5.0, help="$/h per GPU")
    c.add_argument("--p-mem", type=_number(0), default=0.0088, help="$/GB-h DRAM")
    c.add_argument("--p-ssd", type=_number(0), default=0.000082, help="$/GB-h SSD")
    _add_wear_args(c)
    c.set_defaults(fn=cmd_cost)
    return ap


# What a command needs beyond the base install, by the module whose import failed.
EXTRAS = {"sglang": f"needs SGLang: {INSTALL_HINT}",
          "torch": "needs PyTorch: pip install torch (a CUDA build to profile a GPU)"}


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    cmd = "tutti-hicache " + a.cmd + (f" {a.what}" if a.cmd == "bench" else "")
    try:
        return a.fn(a)
    except ImportError as e:  # an optional dependency the command needs
        if a.verbose:
            raise
        hint = EXTRAS.get((e.name or "").split(".")[0], "a dependency is missing")
        print(f"{cmd}: {e if 'pip install' in str(e) else f'{hint} ({e})'}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # bad input: a path, a value, a full or read-only medium
        if a.verbose:
            raise
        print(f"{cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
