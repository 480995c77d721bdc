"""LMCache beside tutti in the server benchmark: the `lmcache server` daemon that SGLang 0.5.23's
`--enable-lmcache` dials (multi-process mode; SGLang's connector is
lmcache.integration.sglang.unified_lmcache_mp_connector, first shipped in LMCache 0.5.6).

At a glance:
    CONFIGS                                  lmcache-dram, lmcache-ssd, lmcache-gds
    unavailable() -> None | reason           what stops LMCache from starting here, in one line
    room_error(config, one_dir, l1_gb, working_set_gb)  ONE_DIR too small for it: why, else None
    daemon_cmd(config, port, http_port, one_dir, l1_gb) -> argv
    write_client_config(path, port)          the YAML SGLang's --lmcache-config-file reads
    retrieve_summary(log_path, bytes_per_token) -> dict   LMCache's own retrieve times -> GB/s
    Daemon(argv, log_path, port).wait_ready(timeout) / .stop()

The three configurations, named as the Tutti paper names LMCache's:
    lmcache-dram  L1 only: pinned DRAM of --dram-gb (the same host GB as `dram`)
    lmcache-ssd   an L1 of SSD_L1_GB, evicting early (SSD_EVICTION), in front of LMCache's
                  fs_native L2 (C++ file I/O, O_DIRECT) in ONE_DIR/lmc: the same medium as `file`
                  and `nixl`
    lmcache-gds   GDS L1 in ONE_DIR/lmc-gds (cuFile; compatibility mode where nvidia-fs is absent)
The daemon outlives SGLang's restarts, so a restart phase keeps what it holds (fs_native also
survives the daemon's own restart). Its directories are the harness's to empty (clear_storage).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import time
from typing import Optional

CONFIGS = ("lmcache-dram", "lmcache-ssd", "lmcache-gds")
CONNECTOR = "lmcache.integration.sglang.unified_lmcache_mp_connector"
DIRS = {"lmcache-ssd": "lmc", "lmcache-gds": "lmc-gds"}  # under --one-dir
# lmcache-ssd's L1, LMCache's staging for its L2 reads: a prefetch reserves L1 for every chunk of
# the prefix before it reads one (4.3 GB for a 32K document of the Llama-3-8B shape), and fails
# whole when L1 lacks the room. LMCache frees L1 from a once-a-second loop that, by default, evicts
# 20% of it when it passes 80% full: a 10 GB L1 then never has 4.3 GB free once it has filled, and
# under load every prefetch failed (1440 chunks refused, nothing read from L2; a 2 GB L1 the same).
# So L1 holds three documents' prefetches (what 1-4 req/s keeps in flight) and evicts to a few
# percent once a quarter full: it stages, and what is read back comes from the SSD.
SSD_L1_GB = 16
SSD_EVICTION = ("--eviction-trigger-watermark", "0.25", "--eviction-ratio", "0.8")
CHUNK_TOKENS = 256  # the daemon's --chunk-size: LMCache's unit of storage and of its log's keys


def unavailable() -> Optional[str]:
    """None where LMCache can be tried here, else why not (one line, naming what to install).
    Finding the modules imports nothing of LMCache's native code: whether that loads is found
    when the daemon starts (Daemon.wait_ready reports its log's last lines)."""
    try:
        if importlib.util.find_spec("lmcache") is None:
            return "lmcache is not installed (LMCache >= 0.5.6: SGLang 0.5.23's --enable-lmcache needs " \
                   "its multi-process connector)"
        if importlib.util.find_spec(CONNECTOR) is None:
            from importlib.metadata import version
            return f"lmcache {version('lmcache')} has no {CONNECTOR}, which SGLang 0.5.23's " \
                   "--enable-lmcache imports (first in LMCache 0.5.6)"
    except Exception as e:  # noqa: BLE001 - a broken install is a reason too
        return f"lmcache does not import: {e!r}"
    return None


def room_error(config: str, one_dir: str, l1_gb: float, working_set_gb: float) -> Optional[str]:
    """Where ONE_DIR's filesystem cannot hold what the configuration writes there, why (else
    None), before the daemon starts: lmcache-gds fallocates its whole L1 as one slab file at start
    (the daemon dies with ENOSPC), and lmcache-ssd's fs_native L2 keeps every stored chunk (a full
    filesystem fails its store tasks, and the benchmark would measure recompute)."""
    need = {"lmcache-gds": l1_gb, "lmcache-ssd": working_set_gb}.get(config)
    if not need:
        return None
    where = data_dir(config, one_dir)
    try:
        free = shutil.disk_usage(where if os.path.isdir(where) else one_dir).free / 1e9
    except OSError as e:
        return f"cannot read the free space of {one_dir}: {e}"
    if free < need:
        what = f"its GDS L1 slab of {need:g} GB" if config == "lmcache-gds" else \
            f"the working set of {need:.1f} GB in its fs_native L2"
        return (f"{config}: {what} does not fit in {one_dir} ({free:.1f} GB free); give that "
                f"filesystem more room (bench/media.sh: ONE_GIB) or a smaller --dram-gb / --docs")
    return None


def data_dir(config: str, one_dir: str) -> Optional[str]:
    name = DIRS.get(config)
    return os.path.join(one_dir, name) if name else None


TRANSFER_MODES = ("lmcache_driven", "engine_driven")


def daemon_cmd(config: str, port: int, http_port: int, one_dir: str, l1_gb: float,
               transfer_mode: str = "lmcache_driven") -> list:
    """The `lmcache server` command of a configuration: L1 of l1_gb (lmcache-dram; lmcache-ssd's
    is SSD_L1_GB with SSD_EVICTION, the staging its L2 restores need), LRU, observability off,
    every socket on 127.0.0.1, and who moves the KV: the daemon through CUDA IPC (lmcache_driven,
    LMCache's default) or SGLang's worker through shared memory (engine_driven)."""
    if config not in CONFIGS:
        raise ValueError(f"unknown LMCache configuration {config!r} (one of {', '.join(CONFIGS)})")
    if transfer_mode not in TRANSFER_MODES:
        raise ValueError(f"unknown LMCache transfer mode {transfer_mode!r} (one of {', '.join(TRANSFER_MODES)})")
    cmd = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
           "--http-host", "127.0.0.1", "--http-port", str(http_port), "--eviction-policy", "LRU",
           "--disable-observability", "--chunk-size", str(CHUNK_TOKENS), "--supported-transfer-mode", transfer_mode]
    if config == "lmcache-dram":
        return cmd + ["--l1-size-gb", f"{l1_gb:g}"]
    if config == "lmcache-ssd":
        adapter = {"type": "fs_native", "base_path": data_dir(config, one_dir), "num_workers": 16,
                   "use_odirect": True}
        return cmd + ["--l1-size-gb", f"{SSD_L1_GB:g}", *SSD_EVICTION, "--l2-adapter", json.dumps(adapter)]
    return cmd + ["--l1-size-gb", f"{l1_gb:g}", "--gds-l1-path", data_dir(config, one_dir)]


_RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([0-9.]+) seconds")
# A prefetch (L2 -> L1 ahead of a retrieve): "Prefetch request completed (L1+L2): 97/128 retained
# keys (0 L1, 97 L2) in 3094.6 ms"; and the prefetches that could not reserve L1 for their chunks.
_PREFETCHED = re.compile(r"Prefetch request completed \([^)]*\): (\d+)/(\d+) retained keys "
                         r"\((\d+) L1, (\d+) L2\) in ([0-9.]+) ms")
_RESERVE_FAILED = re.compile(r"prefetch:\d+: (\d+) L1 reservations failed")


def retrieve_summary(log_path: str, bytes_per_token: int) -> dict:
    """LMCache's restores as its daemon logs them, at the model's KV bytes per token ({} when the
    log has none: engine_driven transfers, or a daemon that did not start):
      restore_GBps, lmcache_retrieves   each retrieve into SGLang's pool ("Retrieved N tokens in
                                        S seconds", LMCache 0.5.6's lmcache_driven transfer)
      lmcache_prefetches                its L2 -> L1 prefetches (lmcache-ssd): chunks asked for,
                                        found in L1 and read from L2, and the L2 rate over the
                                        prefetches that read any (their whole wall time: a floor);
                                        reservations_failed counts the chunks refused L1 room."""
    if bytes_per_token <= 0:
        return {}
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    found = [(int(n), float(t)) for n, t in _RETRIEVED.findall(text)]
    found = [(n, t) for n, t in found if n and t > 0]
    if found:
        tokens, seconds = sum(n for n, _ in found), sum(t for _, t in found)
        rates = sorted(n * bytes_per_token / t / 1e9 for n, t in found)
        out["restore_GBps"] = tokens * bytes_per_token / seconds / 1e9
        out["lmcache_retrieves"] = {"count": len(found), "tokens": tokens, "seconds": seconds,
                                    "GBps_p50": rates[len(rates) // 2], "GBps_min": rates[0],
                                    "GBps_max": rates[-1]}
    pre = [tuple(int(x) for x in m[:4]) + (float(m[4]) / 1e3,) for m in _PREFETCHED.findall(text)]
    failed = [int(n) for n in _RESERVE_FAILED.findall(text)]
    if pre or failed:
        l2 = [(c, t) for _, _, _, c, t in pre if c and t > 0]
        l2_chunks, l2_s = sum(c for c, _ in l2), sum(t for _, t in l2)
        out["lmcache_prefetches"] = {
            "count": len(pre), "chunks_asked": sum(p[1] for p in pre),
            "chunks_retained": sum(p[0] for p in pre), "from_l1": sum(p[2] for p in pre),
            "from_l2": l2_chunks, "l2_seconds": l2_s,
            "l2_GBps": l2_chunks * CHUNK_TOKENS * bytes_per_token / l2_s / 1e9 if l2_s else None,
            "reservations_failed": {"prefetches": len(failed), "chunks": sum(failed)}}
    return out


def write_client_config(path: str, port: int) -> str:
    """SGLang's --lmcache-config-file: the daemon's address (MP mode)."""
    with open(path, "w") as f:
        f.write(f"# SGLang dials the harness's `lmcache server` here (multi-process mode)\n"
                f"mp_host: 127.0.0.1\nmp_port: {port}\n")
    return path


class Daemon:
    """One `lmcache server` process group; waits end as soon as it is gone."""

    def __init__(self, cmd: list, log_path: str, port: int, env: Optional[dict] = None):
        self.port = port
        self.log_path = log_path
        from .server import start_group
        env = dict(os.environ if env is None else env, LMCACHE_TRACK_USAGE="false")  # no telemetry
        self.proc, self.log = start_group(cmd, env, log_path)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 6) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(ln.strip() for ln in f.read().splitlines()[-lines:] if ln.strip())
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> float:
        """Seconds until the daemon accepts connections on its port; RuntimeError with its log's
        last lines if it exits first, TimeoutError after `timeout`."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if not self.alive():
                raise RuntimeError(f"the LMCache daemon exited with {self.proc.returncode}: {self.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return time.time() - t0
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"the LMCache daemon did not listen on {self.port} within {timeout:.0f} s: "
                           f"{self.tail()}")

    def stop(self) -> None:
        from .server import stop_group
        stop_group(self.proc, 30)
        self.log.close()
