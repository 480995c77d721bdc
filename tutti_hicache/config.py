"""One frozen configuration for the store, the SGLang backend and the linker.

At a glance:
    TuttiConfig.from_sources(extra_config, env=os.environ) -> TuttiConfig
    TuttiConfig fields: one per setting, declared once with setting(default, doc, ...)
    SETTINGS: the table of every key (name, type, default, meaning), generated from the fields;
              settings_markdown() renders it for docs/settings.md.

Each setting ``<name>`` is read from the key ``tutti_<name>`` of SGLang's extra config
(``--hicache-storage-backend-extra-config`` or the linker's ``linker_extra_config``), else
from the environment variable ``TUTTI_HICACHE_<NAME>``, else its default. Keys without the
``tutti_`` prefix belong to SGLang and are ignored here. An unknown ``tutti_`` key, a wrong
type or an out-of-range value raises ``ValueError`` naming the key (directories are checked
where they are used: namespace.check_dirs). No I/O here.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

PREFIX = "tutti_"
ENV_PREFIX = "TUTTI_HICACHE_"
MAX_QUEUE_DEPTH = 32768  # io_uring_setup refuses more entries (-EINVAL)
GiB = 1 << 30


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # "str", "int", "float", "bool", "dirs", "choice"
    default: Any
    doc: str
    choices: tuple = ()
    minimum: Optional[float] = None


def setting(default: Any, doc: str, *, kind: Optional[str] = None, choices: tuple = (),
            minimum: Optional[float] = None):
    """A TuttiConfig field that is also a row of SETTINGS. kind defaults to "choice" when there
    are choices, else the field's annotation (str, int, float or bool)."""
    meta = {"doc": doc, "kind": kind or ("choice" if choices else None), "choices": tuple(choices),
            "minimum": minimum}
    return dataclasses.field(default=default, metadata=meta)


def _parse_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.strip().lower() in ("1", "true", "yes", "on")
    raise ValueError(f"{key}: expected a boolean, got {v!r}")


def _parse_number(key: str, v: Any, cast: Callable) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"{key}: expected a number, got {v!r}")
    try:
        out = cast(v)
    except (TypeError, ValueError, OverflowError):  # int(inf): OverflowError
        raise ValueError(f"{key}: expected a number, got {v!r}") from None
    if cast is int and isinstance(v, float) and v != out:
        raise ValueError(f"{key}: expected an integer, got {v!r}")
    if not math.isfinite(out):
        raise ValueError(f"{key}: expected a finite number, got {v!r}")
    return out


def _parse_dirs(key: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        text = v.strip()
        if text.startswith("["):
            try:
                v = json.loads(text)
            except ValueError as e:
                raise ValueError(f"{key}: not a valid JSON list ({e.msg} at character {e.pos}) in "
                                 f"{text!r}; write it as [\"/nvme0/kv\", \"/nvme1/kv\"], or as "
                                 "a comma-separated string") from None
        else:
            v = [p for p in text.replace(":", ",").split(",") if p.strip()]
    if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) and p.strip() for p in v):
        raise ValueError(f"{key}: expected a list of directory paths, got {v!r}")
    dirs = tuple(os.path.abspath(os.path.expanduser(p.strip())) for p in v)
    if len(set(dirs)) != len(dirs):
        raise ValueError(f"{key}: directories must be distinct, got {list(dirs)}")
    return dirs


def _parse(setting: Setting, key: str, v: Any) -> Any:
    if setting.kind == "bool":
        return _parse_bool(key, v)
    if setting.kind == "dirs":
        return _parse_dirs(key, v)
    if setting.kind in ("int", "float"):
        out = _parse_number(key, v, int if setting.kind == "int" else float)
        if setting.minimum is not None and out < setting.minimum:
            raise ValueError(f"{key}: must be >= {setting.minimum}, got {v!r}")
        return out
    if not isinstance(v, str):
        raise ValueError(f"{key}: expected a string, got {v!r}")
    if setting.kind == "choice" and v not in setting.choices:
        raise ValueError(f"{key}: expected one of {list(setting.choices)}, got {v!r}")
    return v


@dataclass(frozen=True)
class TuttiConfig:
    """Every setting, declared once: its field's default, and its metadata (meaning, kind, bounds)
    from which SETTINGS and the docs/settings.md table are generated."""

    dirs: tuple[str, ...] = setting((),
        "Store directories, one per SSD (JSON list, or a comma/colon separated string in the env "
        "var). Required.", kind="dirs")
    capacity_gb: float = setting(64.0,
        "Byte cap of this identity's store, over all directories together (GB = 2^30 bytes). "
        "At attach it is lowered, with one warning, to what the directories' filesystems can "
        "hold (their free space plus this store's own segments, less tutti_free_space_floor_gb).",
        minimum=0.0)
    engine: str = setting("auto",
        "I/O engine: auto (io_uring, else POSIX threads, reason logged once), uring, posix.",
        choices=("auto", "uring", "posix"))
    queue_depth: int = setting(0,
        "io_uring operations in flight per batch. 0: bytes in flight derived from the devices' "
        "queues (nr_requests x request size) and the cores (see docs/design.md); >= 8: this many "
        "operations, no byte cap.", minimum=0)
    threads: int = setting(8,
        "POSIX engine workers per direction, and checksum/copy threads.", minimum=1)
    verify: bool = setting(True,
        "Verify the XXH3 checksum of every page read (slots published by another process are "
        "always verified).")
    revision: str = setting("",
        "Weights revision, part of the identity: a weight update never replays stale KV.")
    model: str = setting("", "Model identity override (default: SGLang's --model-path; set one name where servers load the same weights from different paths).")
    segment_gb: float = setting(0.0,
        "Size of one preallocated segment file (an existing namespace keeps the size it was "
        "created with). 0: 1 GiB, or an eighth of the directory's filesystem where that is "
        "smaller than 8 GiB; a size larger than a directory's filesystem is refused at attach.",
        minimum=0.0)
    durability: str = setting("none",
        "none: crash-consistent against process kills (payload before header, O_DIRECT); sync: "
        "also fdatasync before and after publishing headers (power-loss safe, slower).",
        choices=("none", "sync"))
    rescan_interval_s: float = setting(1.0,
        "Minimum seconds between re-scans of segments other processes changed (triggered by a "
        "miss).", minimum=0.0)
    free_space_floor_gb: float = setting(0.0,
        "Refuse to grow segment files when the filesystem would keep less free space than this.",
        minimum=0.0)
    scheduler: bool = setting(True,
        "Slack-aware I/O scheduling: reads first, no write on a directory while a read is pending"
        " or in flight there, writes in window-sized chunks.")
    write_window_ms: float = setting(2.0,
        "Default write window (ms) per chunk when no slack table gives one: a new read waits "
        "behind at most one chunk this long.", minimum=0.1)
    write_floor_ms: float = setting(500.0,
        "Write floor: after this long without write progress, one chunk goes ahead of new reads.",
        minimum=1.0)
    write_backlog_mb: int = setting(4096,
        "Queued write bytes (MiB) above which new stores are refused at once (batch_set_v1 / "
        "offload return False).", minimum=1)
    slack_table: str = setting("",
        "Linker: slack table file from `tutti-hicache profile`: the seed of the online write "
        "windows (tutti_write_windows=online) or the windows themselves (=table).")
    write_windows: str = setting("online",
        "Linker: write windows between layer reads. online: learned from the server's own "
        "forwards (per-layer compute from CUDA events), seeded by tutti_slack_table if given; "
        "table: the slack table alone; off: writes run only when no read is pending.",
        choices=("online", "table", "off"))
    timeline_file: str = setting("",
        "Append JSON lines to this file ({pid} is replaced), to see where a restore's time goes. "
        "Host tier: one per exists/get/set call SGLang makes (CLOCK_MONOTONIC entry and return, "
        "keys, hits, thread). Linker: one per layer-wise load: its pages read, from the DRAM "
        "tier and copied in the pool; CLOCK_MONOTONIC nanoseconds of the load's start, each "
        "staging chunk's reads becoming final, each layer handed to the forward, the forward's "
        "wait_until entry and exit per layer and finish_layer_wise_loading's "
        "(tutti_hicache/benchmarks/timeline.py reads both). Empty: off.")
    stats_file: str = setting("",
        "Write the backend's counters (hits, misses, bytes, checksum failures, engine calls) as "
        "JSON to this file, at most once a second (a change is written when that second ends, or at a "
        "normal exit) and at close ({pid} is replaced by each process's id).")
    drive_capacity_gb: float = setting(0.0,
        "Capacity of the drive behind each store directory, for the drive-writes-per-day "
        "projection of the wear counters (GB = 10^9 bytes, as drives are rated); 0: the size of "
        "the directory's filesystem (statvfs).", minimum=0.0)
    stage_mb: int = setting(256,
        "Linker: bytes of one pinned staging slot (one layer of up to this many MiB of pages per "
        "copy); memory does not grow with sequence length.", minimum=1)
    stage_depth: int = setting(4,
        "Linker: pinned staging slots in the read ring: one being copied to the device, the "
        "others being read (read_ahead).", minimum=2)
    offload_writers: int = setting(2,
        "Linker: offload chunks (of tutti_stage_mb) written at once, each from its own pinned "
        "slot (one more slot is gathered into meanwhile: writers + 1 pinned slots of stage_mb). "
        "On idle directories their chunks share the device queues up to the bytes those hold.",
        minimum=1)
    read_ahead: int = setting(3,
        "Linker: staging chunks (layers) admitted to the read stream at once: the next layers' "
        "requests wait at the devices behind this layer's, so the queue never drains between "
        "layers; 1 reads layer after layer. At most stage_depth - 1 are used.", minimum=1)
    io_sms: int = setting(8,
        "Linker: SMs reserved for the I/O kernels through a CUDA green context (Hopper); 0 = an "
        "ordinary high-priority stream.", minimum=0)
    host_gb: float = setting(-1.0,
        "Linker: pinned DRAM tier in front of the SSD store (GB = 2^30 bytes): loads take each "
        "page from DRAM where it is resident, offloaded pages are kept there too, and pages read "
        "from the SSD a second time are copied up (2Q: a scan of new pages takes at most a quarter of the hot ones). -1: an "
        "eighth of the machine's memory shared by its GPUs' servers (none without a GPU); 0: off.",
        minimum=-1.0)
    offload_backlog_pages: int = setting(8192,
        "Linker: pages queued for offload before new offloads are refused (the device pages stay "
        "locked until written).", minimum=1)

    cluster_publish: str = setting("all",
        "Tiered backend: pages offered to the cluster tier (Mooncake): all (every page stored), "
        "hit (only pages served from the local SSD, i.e. prefixes that were reused), off (this "
        "node only reads the cluster).", choices=("all", "hit", "off"))
    cluster_promote: bool = setting(True,
        "Tiered backend: copy pages read from the cluster tier into the local SSD tier, so they "
        "outlive the node that published them.")
    cluster_promote_mb: int = setting(1024,
        "Tiered backend: memory (MiB) holding promoted pages between the remote read and their "
        "write into the SSD tier, which then runs on a thread of its own, off SGLang's read call; "
        "pages beyond it are written inside the call. 0 = every promotion inside the call.",
        minimum=0)
    cluster_retry_s: float = setting(5.0,
        "Tiered backend: seconds between attempts to reach the cluster tier while it is "
        "unreachable or down (the backend serves the local SSD tier meanwhile).", minimum=0.05)
    cluster_timeout_s: float = setting(3.0,
        "Tiered backend: bound on one cluster tier call while the Mooncake master or a peer node "
        "hangs: applied before the Mooncake client is made to MC_RPC_TIMEOUT_MS (a master "
        "request) and MC_TCP_PROGRESS_TIMEOUT_SEC (a TCP transfer without progress, whole "
        "seconds), each unless already set in the environment (an exported value wins); also "
        "bounds the check that the master answers before the client is made.", minimum=0.1)

    def __post_init__(self) -> None:
        if 0 < self.queue_depth < 8 or self.queue_depth > MAX_QUEUE_DEPTH:
            raise ValueError(f"{PREFIX}queue_depth: 0 (derived from the devices) or 8 to "
                             f"{MAX_QUEUE_DEPTH} (io_uring's most entries), got {self.queue_depth}")
        if -1 < self.host_gb < 0 or self.host_gb < -1:
            raise ValueError(f"{PREFIX}host_gb: -1 (auto), 0 (off) or a size in GiB, got "
                             f"{self.host_gb}")

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GiB)

    @property
    def segment_bytes(self) -> int:
        return int(self.segment_gb * GiB)

    @classmethod
    def from_sources(cls, extra_config: Optional[Mapping[str, Any]] = None,
                     env: Optional[Mapping[str, str]] = None, **overrides: Any) -> "TuttiConfig":
        """Merge defaults < environment < extra_config < overrides, validate, and return."""
        env = os.environ if env is None else env
        extra = dict(extra_config or {})
        # ours in any case or separator (tutti-capacity-gb, Tutti_capacity_gb): a misspelt key
        # would otherwise leave its setting at the default without a word
        unknown = [k for k in extra if isinstance(k, str) and _ours(k, PREFIX)
                   and (not k.startswith(PREFIX) or k[len(PREFIX):] not in _BY_NAME)]
        unknown += [k for k in env if _ours(k, ENV_PREFIX) and env.get(k, "") != ""
                    and (not k.startswith(ENV_PREFIX) or k[len(ENV_PREFIX):].lower() not in _BY_NAME
                         or k != k.upper())]
        if unknown:
            raise ValueError(_unknown(unknown[0]))
        values: dict[str, Any] = {}
        for s in SETTINGS:
            env_key = ENV_PREFIX + s.name.upper()
            if PREFIX + s.name in extra:
                values[s.name] = _parse(s, PREFIX + s.name, extra[PREFIX + s.name])
            elif env.get(env_key, "") != "":
                values[s.name] = _parse(s, env_key, env[env_key])
        for name, v in overrides.items():
            if name not in _BY_NAME:
                raise ValueError(_unknown(PREFIX + name))
            values[name] = _parse(_BY_NAME[name], PREFIX + name, v)
        return cls(**values)

    def with_(self, **changes: Any) -> "TuttiConfig":
        for name, v in changes.items():
            _parse(_BY_NAME[name], PREFIX + name, v)
        return dataclasses.replace(self, **changes)



def _settings() -> tuple[Setting, ...]:
    rows = []
    for f in dataclasses.fields(TuttiConfig):
        if "doc" not in f.metadata:
            raise TypeError(f"TuttiConfig.{f.name} is not declared with setting()")
        m = f.metadata
        rows.append(Setting(f.name, m["kind"] or str(f.type), f.default, m["doc"], m["choices"],
                            m["minimum"]))
    return tuple(rows)


SETTINGS: tuple[Setting, ...] = _settings()
_BY_NAME = {s.name: s for s in SETTINGS}

# What an operator decides (where the store lives, how big, how safe, which model it caches for,
# what it reports); every other setting is tuning, whose default is what the benchmarks measured.
YOU_SET = ("dirs", "capacity_gb", "durability", "verify", "revision", "model", "free_space_floor_gb",
           "stats_file", "drive_capacity_gb", "host_gb", "cluster_publish", "cluster_promote")
if not set(YOU_SET) <= set(_BY_NAME):
    raise TypeError(f"YOU_SET names no setting: {sorted(set(YOU_SET) - set(_BY_NAME))}")


def _ours(key: str, prefix: str) -> bool:
    """Whether key names a tutti setting in some spelling: prefix in any case, - or _."""
    return key.lower().replace("-", "_").startswith(prefix.lower())


def _unknown(key: str) -> str:
    """An unknown tutti_ key's (or TUTTI_HICACHE_ variable's) message: the closest known key,
    if one is close, else the list."""
    env = key.lower().replace("-", "_").startswith(ENV_PREFIX.lower())
    prefix = ENV_PREFIX if env else PREFIX
    name = key.lower().replace("-", "_")[len(prefix):]
    spell = (lambda n: ENV_PREFIX + n.upper()) if env else (lambda n: PREFIX + n)
    close = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.6)
    if close:  # compared without the prefix every key shares
        return f"{key}: unknown tutti setting; did you mean {spell(close[0])}?"
    return f"{key}: unknown tutti setting (known: {', '.join(sorted(spell(n) for n in _BY_NAME))})"


def settings_markdown() -> str:
    """The two tables of docs/settings.md ("You set these", then "Tuning"), generated from SETTINGS."""
    def table(settings) -> list:
        rows = ["| key | env var | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
        for s in settings:
            kind = "\\|".join(s.choices) if s.kind == "choice" else s.kind  # a bare | splits the cell
            default = json.dumps(list(s.default)) if s.kind == "dirs" else json.dumps(s.default)
            rows.append(f"| `{PREFIX}{s.name}` | `{ENV_PREFIX}{s.name.upper()}` | {kind} | `{default}` | {s.doc} |")
        return rows
    mine = [s for s in SETTINGS if s.name in YOU_SET]
    tuning = [s for s in SETTINGS if s.name not in YOU_SET]
    return "\n".join(["## You set these", ""] + table(mine) + ["", "## Tuning", ""] + table(tuning)) + "\n"
