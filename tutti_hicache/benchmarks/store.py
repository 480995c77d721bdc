"""`tutti-hicache bench store` and `demo`: L3 -> host-pool restore, measured side by side.

At a glance:
    run(BenchSpec) -> dict      one run on one medium: raw O_DIRECT read, tutti write/restore
                                (verify on and off), SGLang HiCacheFile write/restore, all through
                                SGLang's real controller methods into a real host pool
    table(result) -> str        the human-readable table

"Raw" is the best plain O_DIRECT read of a same-size file on the same medium in the same run:
of a sequential 8 MiB read, threads at tutti's own operation size, and tutti's own engine
(io_uring at its queue depth and bytes in flight) at that operation size, one batch per 128
pages as a restore submits them. Every restored page is compared with the page that was written
(byte for byte).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..config import TuttiConfig
from ..hostmap import HostMap
from ..layout import PageGeometry, SlotLayout
from ..testing import sglang as H
from ..testing import controller as HC
from .rawio import drop_page_cache, raw_read_GBps, raw_read_uring_GBps, write_raw_file  # noqa: F401

_DEFAULTS = TuttiConfig()

GEOMETRIES = {
    # name: (kind, layers, kv heads or kv_lora_rank, head_dim or rope dim, page, dtype)
    "small": ("mha", 8, 8, 128, 64, "bfloat16"),
    "llama3-8b": ("mha", 32, 8, 128, 64, "bfloat16"),
    "llama3-70b-tp8": ("mha", 80, 1, 128, 64, "bfloat16"),
    "qwen3-30b-a3b": ("mha", 48, 4, 128, 64, "bfloat16"),
    "deepseek-v3": ("mla", 61, 512, 64, 64, "bfloat16"),
}
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
_ITEM_NBYTES = {"bfloat16": 2}


def page_geometry(geometry: str) -> PageGeometry:
    """The page a geometry of GEOMETRIES stores (before any pool is built: no SGLang, no torch)."""
    kind, layers, a, b, page, dtype = GEOMETRIES[geometry]
    k, v = (a * b, a * b) if kind == "mha" else (a + b, 0)
    item = _ITEM_NBYTES[dtype]
    return PageGeometry(kind, layers, page, k * item, v * item)


def check_medium(spec: "BenchSpec") -> None:
    """ValueError naming --medium when it cannot be written, or lacks the room this run needs:
    the store's pages (with their slot headers), the raw file and the file backend's copy."""
    copies = 3 if spec.with_file else 2
    need = copies * spec.pages * (page_geometry(spec.geometry).page_nbytes + (8 << 10)) + (16 << 20)
    try:
        os.makedirs(spec.medium, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".tutti-bench-probe-", dir=spec.medium))
        st = os.statvfs(spec.medium)
    except OSError as e:
        raise ValueError(f"--medium {spec.medium}: cannot write there ({e.strerror})") from None
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise ValueError(f"--medium {spec.medium}: {free >> 20} MiB free, and this run writes "
                         f"about {need >> 20} MiB ({spec.pages} pages, {copies} copies); free "
                         "space there or lower --pages")


@dataclass
class BenchSpec:
    medium: str
    geometry: str = "llama3-8b"
    pages: int = 256
    layout: str = "layer_first"
    engine: str = _DEFAULTS.engine  # the tutti_* settings' defaults
    queue_depth: int = _DEFAULTS.queue_depth
    threads: int = _DEFAULTS.threads
    with_file: bool = True
    keep: bool = False
    seed: int = 0
    pin_memory: bool = False  # pinned (cudaHostRegister) host pool, as a GPU server has
    extra: dict = field(default_factory=dict)


def make_pool(geometry: str, layout: str, n_pages: int, pin_memory: bool = False):
    import torch
    kind, layers, a, b, page, dtype = GEOMETRIES[geometry]
    dt = getattr(torch, dtype)
    if kind == "mha":
        return H.make_mha_host_pool(layout, layers, a, b, page, dt, n_pages, pin_memory)
    return H.make_mla_host_pool(layout, layers, a, b, page, dt, n_pages, pin_memory)


def fast_fill(pool, seed: int) -> None:
    """Random bytes (never all zero) over the whole host pool, quickly."""
    rng = np.random.default_rng(seed)
    for t in {id(t): t for t in _pool_tensors(pool)}.values():
        flat = t.view(-1).view(__import__("torch").uint8).numpy()
        for start in range(0, flat.size, 1 << 26):
            chunk = flat[start:start + (1 << 26)]
            chunk[:] = np.frombuffer(rng.bytes(chunk.size), dtype=np.uint8) | 1


def _pool_tensors(pool):
    return [pool.kv_buffer] if hasattr(pool, "kv_cache_dim") else [pool.k_buffer, pool.v_buffer]


def pages_equal(pool, src, dst) -> bool:
    """Byte-exact comparison of the pages at src and dst slots (same pool)."""
    import torch
    p = pool.page_size
    for s, d in zip(src[::p].tolist(), dst[::p].tolist()):
        a = pool.get_data_page(s, flat=False).contiguous().view(torch.uint8)
        b = pool.get_data_page(d, flat=False).contiguous().view(torch.uint8)
        if not torch.equal(a, b):
            return False
    return True


# ------------------------------------------------------------------ raw medium: benchmarks/rawio.py


# ------------------------------------------------------------------ backends
def _timed(fn, lat: list):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        lat.append(time.perf_counter() - t0)
        return out
    return wrapper


def _tutti_backend(spec: BenchSpec, store_dir: str, pool, verify: bool):
    from ..storage import TuttiStorage
    slot = SlotLayout(HostMap.from_pool(pool).geometry).slot_nbytes  # the run's pages, no more
    extra = {"tutti_dirs": [store_dir], "tutti_capacity_gb": (spec.pages + 1) * slot / 2**30,
             "tutti_engine": spec.engine,
             "tutti_queue_depth": spec.queue_depth,
             "tutti_threads": spec.threads, "tutti_verify": verify, **spec.extra}
    sc = H.make_storage_config(is_mla=GEOMETRIES[spec.geometry][0] == "mla",
                               is_page_first_layout=spec.layout == "page_first",
                               model_name=f"bench-{spec.geometry}", extra_config=extra)
    t0 = time.perf_counter()
    st = TuttiStorage(sc, {})
    ctrl = HC.make_controller(st, pool, pool.page_size, sc, zero_copy=True)
    return st, ctrl, time.perf_counter() - t0


def _restore(ctrl, backend, keys, dst, attr: str):
    lat: list[float] = []
    setattr(backend, attr, _timed(getattr(backend, attr), lat))
    cpu0, t0 = time.process_time(), time.perf_counter()
    done = HC.controller_transfer(ctrl, keys, dst)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    delattr(backend, attr)
    return done, wall, cpu, lat


def _latency(lat: list[float]) -> dict:
    if not lat:
        return {"p50_ms": None, "p99_ms": None}
    q = np.percentile(np.array(lat) * 1e3, [50, 99])
    return {"p50_ms": float(q[0]), "p99_ms": float(q[1])}


def bench_tutti(spec, work, pool, keys, src, dst, nbytes) -> dict:
    store_dir = os.path.join(work, "tutti")
    st, ctrl, _ = _tutti_backend(spec, store_dir, pool, verify=True)
    t0 = time.perf_counter()
    written = HC.controller_backup(ctrl, keys, src)
    write_s = time.perf_counter() - t0
    st.close()
    out = {"tutti_write_GBps": nbytes / write_s / 1e9, "tutti_written_pages": written}
    for verify in (True, False):
        drop_page_cache([])
        st, ctrl, open_s = _tutti_backend(spec, store_dir, pool, verify=verify)
        c0 = st.store.engine.counters()
        _poison(pool, dst)
        done, wall, cpu, lat = _restore(ctrl, st, keys, dst, "batch_get_v1")
        c1 = st.store.engine.counters()
        ok = done == len(keys) * pool.page_size and pages_equal(pool, src, dst)
        tag = "" if verify else "_noverify"
        out.update({f"tutti_read{tag}_GBps": nbytes / wall / 1e9,
                    f"tutti{tag}_cpu_s_per_GB": cpu / (nbytes / 1e9),
                    f"tutti{tag}_verified_bytes_equal": ok,
                    f"tutti{tag}_batch_latency": _latency(lat)})
        if verify:
            batches = max(1, len(lat))
            out.update({"tutti_open_s": open_s, "engine": st.store.engine.name,
                        "enter_calls_per_batch": (c1["enter_calls"] - c0["enter_calls"]) / batches,
                        "submissions_per_batch": (c1["submissions"] - c0["submissions"]) / batches,
                        "tutti_op_bytes": (c1["bytes"] - c0["bytes"]) / max(1, c1["submissions"] - c0["submissions"]),
                        "tutti_stats": st.tutti_stats()})
        st.close()
    return out


def _poison(pool, dst) -> None:
    """Zero the destination pages so a page the restore skipped cannot compare equal."""
    p = pool.page_size
    for s in dst[::p].tolist():
        pool.get_data_page(s, flat=False).zero_()


def bench_file(spec, work, pool, keys, src, dst, nbytes) -> dict:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    file_dir = os.path.join(work, "file")
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    sc = H.make_storage_config(is_mla=GEOMETRIES[spec.geometry][0] == "mla",
                               is_page_first_layout=spec.layout == "page_first",
                               model_name=f"bench-{spec.geometry}",
                               extra_config={"file_storage_path": file_dir})
    be = HiCacheFile(sc, file_path=file_dir)  # 0.5.17 ignores file_storage_path in extra_config
    ctrl = HC.make_controller(be, pool, pool.page_size, sc, zero_copy=False, backend_type="file")
    t0 = time.perf_counter()
    HC.controller_backup(ctrl, keys, src)
    write_s = time.perf_counter() - t0
    files = [os.path.join(file_dir, f) for f in os.listdir(file_dir)]
    how = drop_page_cache(files)
    be = HiCacheFile(sc, file_path=file_dir)
    ctrl = HC.make_controller(be, pool, pool.page_size, sc, zero_copy=False, backend_type="file")
    _poison(pool, dst)
    done, wall, cpu, lat = _restore(ctrl, be, keys, dst, "batch_get")
    ok = done == len(keys) * pool.page_size and pages_equal(pool, src, dst)
    return {"file_write_GBps": nbytes / write_s / 1e9, "file_read_GBps": nbytes / wall / 1e9,
            "file_cpu_s_per_GB": cpu / (nbytes / 1e9), "file_verified_bytes_equal": ok,
            "file_batch_latency": _latency(lat), "page_cache_drop": how}


def run(spec: BenchSpec) -> dict:
    if spec.pin_memory:
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--pin (pin_memory) registers the host pool with CUDA, and CUDA is not "
                             "available here; run without it")
    version = H.ensure_sglang()
    check_medium(spec)
    work = tempfile.mkdtemp(prefix="tutti-bench-", dir=spec.medium)
    from tqdm import tqdm
    bar = tqdm(total=5 if spec.with_file else 4, desc="bench store", unit="phase", leave=False)
    try:
        bar.set_postfix_str("host pool")
        pool = make_pool(spec.geometry, spec.layout, 2 * spec.pages + 1, spec.pin_memory)
        fast_fill(pool, spec.seed)
        bar.update()
        p = pool.page_size
        src, dst = pool.alloc(spec.pages * p), pool.alloc(spec.pages * p)
        keys = H.make_page_keys(spec.pages, spec.seed)
        hm = HostMap.from_pool(pool)
        nbytes = spec.pages * hm.geometry.page_nbytes
        res = {"spec": asdict(spec), "sglang": version, "bytes": nbytes,
               "page_bytes": hm.geometry.page_nbytes, "object_bytes": int(hm.object_nbytes[0]),
               "host_aligned": hm.aligned}
        # the raw reads bracket tutti's (one round before, two after): a medium's speed drifts
        raw_path, batch = os.path.join(work, "raw.bin"), BATCH * hm.geometry.page_nbytes
        write_raw_file(raw_path, nbytes)
        before = raw_passes(spec, raw_path, nbytes, SlotLayout(hm.geometry).payload_nbytes,
                            batch, rounds=1)
        bar.set_postfix_str("tutti write/restart/restore")
        res.update(bench_tutti(spec, work, pool, keys, src, dst, nbytes))
        bar.update()
        bar.set_postfix_str("raw O_DIRECT read")
        op = int(res["tutti_op_bytes"])  # what tutti's engine submitted, per operation
        after = raw_passes(spec, raw_path, nbytes, op, batch, rounds=2)
        os.unlink(raw_path)
        res.update(raw_summary({k: before[k] + after[k] for k in after}, op))
        bar.update()
        if spec.with_file:
            bar.set_postfix_str("SGLang file backend")
            res.update(bench_file(spec, work, pool, keys, src, dst, nbytes))
            bar.update()
        res["tutti_pct_of_raw"] = 100 * res["tutti_read_GBps"] / res["raw_read_GBps"]
        if res.get("file_read_GBps"):
            res["tutti_over_file"] = res["tutti_read_GBps"] / res["file_read_GBps"]
        bar.update()
        return res
    finally:
        bar.close()
        if not spec.keep:
            shutil.rmtree(work, ignore_errors=True)


def raw_passes(spec: BenchSpec, path: str, nbytes: int, op: int, batch_nbytes: int,
               rounds: int) -> dict:
    """Plain O_DIRECT reads of `path`, each `rounds` times: sequential 8 MiB, threads at `op`
    bytes (spec.threads and 4x deep), tutti's engine at `op` bytes and its own depth, one
    batch per batch_nbytes. {kind: [GB/s per pass]}."""
    passes: dict[str, list] = {"seq_8MiB": [], "parallel": [], "uring": []}
    for _ in range(rounds):
        drop_page_cache([path])
        passes["seq_8MiB"].append(raw_read_GBps(path, nbytes, 8 << 20, 1))
        passes["parallel"].append(max(raw_read_GBps(path, nbytes, op, n)
                                      for n in (spec.threads, 4 * spec.threads)))
        passes["uring"].append(raw_read_uring_GBps(path, nbytes, op, batch_nbytes, [spec.medium],
                                                   spec.engine, spec.queue_depth, spec.threads))
    return passes


def raw_summary(passes: dict, op: int) -> dict:
    """The raw baseline: the best pass of any kind (the medium at its best)."""
    out = {f"raw_{k}_GBps": max(v) for k, v in passes.items()}
    return {**out, "raw_read_GBps": max(out.values()), "raw_passes_GBps": passes,
            "raw_op_bytes": max(4096, op // 4096 * 4096)}


def beyond_raw(r: dict) -> str:
    """Why tutti's restore read more than 5% faster than the best raw read, in one line; ""
    when it did not. The raw passes' spread is the medium's own drift during the run."""
    gap = r["tutti_pct_of_raw"] / 100 - 1
    if gap <= 0.05:
        return ""
    passes = [x for v in r["raw_passes_GBps"].values() for x in v]
    best = max(r["raw_passes_GBps"].values(), key=max)
    lo, hi = min(best), max(best)
    head = f"tutti read {gap:.0%} faster than the best raw read: "
    if hi / lo - 1 >= gap:
        return head + (f"within this medium's own drift, as the same raw read ranged "
                       f"{lo:.2f}-{hi:.2f} GB/s over the run (other I/O on it, or a virtual "
                       "disk); rerun on an idle medium")
    return head + (f"beyond this medium's drift over the run ({min(passes):.2f}-{hi:.2f} GB/s "
                   "for all raw passes), so the raw reads fell short of it here; please report "
                   "this table")


def table(r: dict) -> str:
    def f(v, unit=""):
        return "-" if v is None else (f"{v:.2f}{unit}" if isinstance(v, float) else f"{v}{unit}")
    lat = r.get("tutti_batch_latency", {})
    flat = r.get("file_batch_latency", {})
    rows = [
        ("medium", r["spec"]["medium"], ""), ("geometry / layout", f"{r['spec']['geometry']} / {r['spec']['layout']}", ""),
        ("pages x bytes", f"{r['spec']['pages']} x {r['page_bytes']}", f"{r['bytes'] / 2**30:.2f} GiB"),
        ("raw O_DIRECT read GB/s", f(r["raw_read_GBps"]), f"best of: seq 8MiB {f(r['raw_seq_8MiB_GBps'])}, threads {f(r['raw_parallel_GBps'])}, tutti's engine {f(r['raw_uring_GBps'])} ({r['raw_op_bytes'] >> 10} KiB ops)"),
        ("tutti restore GB/s (verify on)", f(r["tutti_read_GBps"]), f"{f(r['tutti_pct_of_raw'])}% of raw"),
        ("tutti restore GB/s (verify off)", f(r["tutti_read_noverify_GBps"]), ""),
        ("SGLang file restore GB/s", f(r.get("file_read_GBps")), f"tutti/file = {f(r.get('tutti_over_file'))}x"),
        ("tutti / file write GB/s", f"{f(r['tutti_write_GBps'])} / {f(r.get('file_write_GBps'))}", ""),
        ("CPU s per GB restored (tutti / file)", f"{f(r['tutti_cpu_s_per_GB'])} / {f(r.get('file_cpu_s_per_GB'))}", ""),
        ("io_uring_enter per 128-page batch", f(r["enter_calls_per_batch"]), f"engine {r['engine']}, {f(r['submissions_per_batch'])} SQEs/batch"),
        ("batch latency p50/p99 ms (tutti)", f"{f(lat.get('p50_ms'))} / {f(lat.get('p99_ms'))}", ""),
        ("batch latency p50/p99 ms (file)", f"{f(flat.get('p50_ms'))} / {f(flat.get('p99_ms'))}", ""),
        ("restored bytes equal (tutti / file)", f"{r['tutti_verified_bytes_equal']} / {r.get('file_verified_bytes_equal')}", ""),
        ("store open (index rebuild) s", f(r["tutti_open_s"]), ""),
    ]
    w = max(len(a) for a, _, _ in rows)
    return "\n".join(f"{a:<{w}}  {b:>14}  {c}" for a, b, c in rows)
