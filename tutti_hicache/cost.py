"""The paper's cost per 1M tokens, and the SSD wear term beside it (`tutti-hicache cost`).

At a glance:
    cost_per_million(throughput_tps, gpus, dram_gb, ssd_gb, p_gpu, p_mem, p_ssd) -> $
        (P_gpu*N_gpu + P_mem*S_mem + P_ssd*S_ssd) / (tokens per hour) * 1e6: renting the GPUs,
        the DRAM and the SSD capacity that holds the prefixes
    Endurance(dwpd, warranty_years, drive_usd, drive_tb)   a drive's rating and price
        .usd_per_tb_written          replacement cost of writing 10^12 bytes
        .per_million(bytes_per_mtok) -> $ per 1M tokens: the wear term
        .dwpd_at(bytes_per_s, drives) -> drive writes per day of each drive at that rate
        .years_at(dwpd) -> years the rated endurance lasts at a measured drive-writes-per-day
    format_write_amplification(geometry, reused=True) -> bytes a page write puts on the drive
        per byte of KV (payload, header, the tombstone of a reused slot) on the zero-copy path
    prefill_rows(result, endurance, sessions, ...) -> [CostRow]   from a bench_prefill JSON
    measured_rate(stats) -> (physical bytes/s, write amplification) of a tutti_stats_file

Wear term: SSD replacement cost per 1M tokens = (bytes written per 1M tokens) / (DWPD rating x
capacity x 365 x warranty years) x drive price. The drive's capacity cancels once the price is
per TB, so only the rating, the warranty and $/TB matter. Defaults (override with the flags): a
7.68 TB datacenter TLC NVMe drive rated 1 drive write per day for 5 years at $800 (about $104 per
TB; a 2025 street price of that class), i.e. $0.057 per TB written.
No I/O here except reading the JSON files the CLI names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .layout import HEADER_NBYTES, PageGeometry

DEFAULT_DWPD = 1.0
DEFAULT_WARRANTY_YEARS = 5.0
DEFAULT_DRIVE_USD = 800.0
DEFAULT_DRIVE_TB = 7.68
TB = 1e12


def cost_per_million(throughput_tps: float, gpus: float, dram_gb: float, ssd_gb: float,
                     p_gpu: float = 5.0, p_mem: float = 0.0088, p_ssd: float = 0.000082) -> float:
    """$ per 1M tokens = (P_gpu*N_gpu + P_mem*S_mem + P_ssd*S_ssd) / (tokens per hour) * 1e6."""
    per_hour = p_gpu * gpus + p_mem * dram_gb + p_ssd * ssd_gb
    return per_hour / (throughput_tps * 3600.0) * 1e6


@dataclass(frozen=True)
class Endurance:
    """A drive's endurance rating and price: the replacement cost of the bytes written to it."""
    dwpd: float = DEFAULT_DWPD
    warranty_years: float = DEFAULT_WARRANTY_YEARS
    drive_usd: float = DEFAULT_DRIVE_USD
    drive_tb: float = DEFAULT_DRIVE_TB

    def __post_init__(self):
        if min(self.dwpd, self.warranty_years, self.drive_tb) <= 0 or self.drive_usd < 0:
            raise ValueError("SSD rating: DWPD, warranty years and capacity must be > 0, "
                             "the price >= 0")

    @property
    def rated_bytes(self) -> float:
        """Bytes the drive is rated to take: DWPD x capacity x 365 x warranty years."""
        return self.dwpd * self.drive_tb * TB * 365.0 * self.warranty_years

    @property
    def usd_per_tb_written(self) -> float:
        return self.drive_usd / self.rated_bytes * TB

    def per_million(self, bytes_per_mtok: float) -> float:
        """$ per 1M tokens of replacing drives worn by bytes_per_mtok written per 1M tokens."""
        return bytes_per_mtok / self.rated_bytes * self.drive_usd

    def dwpd_at(self, bytes_per_s: float, drives: float = 1.0) -> float:
        """Drive writes per day of each of `drives` such drives sharing bytes_per_s."""
        return bytes_per_s * 86400.0 / (drives * self.drive_tb * TB)

    def years_at(self, dwpd: float) -> Optional[float]:
        """Years until the rated endurance is used up at `dwpd` measured (None at 0)."""
        return self.dwpd * self.warranty_years / dwpd if dwpd > 0 else None


def format_write_amplification(geometry: PageGeometry, reused: bool = True) -> float:
    """Drive bytes per KV byte of one page stored on the zero-copy path: the objects, the slot
    header, and (reused: the store is full and evicts) the tombstone written before reusing the
    slot. The bounce path also writes each object's padding to 4 KiB; measured figures
    (`--stats`) include everything."""
    extra = HEADER_NBYTES * (2 if reused else 1)
    return (geometry.page_nbytes + extra) / geometry.page_nbytes


@dataclass(frozen=True)
class CostRow:
    config: str
    C: int
    h: float
    tokens_per_s: float
    usd_per_mtok: float  # the paper's: GPUs, DRAM, SSD capacity
    written_bytes_per_mtok: float
    wear_usd_per_mtok: float

    @property
    def total_usd_per_mtok(self) -> float:
        return self.usd_per_mtok + self.wear_usd_per_mtok

    @property
    def written_bytes_per_s(self) -> float:
        """At this throughput, sustained."""
        return self.written_bytes_per_mtok * self.tokens_per_s / 1e6


def prefill_geometry(shape: dict) -> PageGeometry:
    """The KV page of a bench_prefill shape (bf16 K and V per layer, shape["page"] tokens)."""
    token = shape["kv_heads"] * shape["head_dim"] * 2
    return PageGeometry("mha", shape["layers"], shape.get("page", 64), token, token)


def prefill_rows(result: dict, endurance: Endurance, sessions: float, gpus: float,
                 prices: tuple, write_amplification: Optional[float] = None) -> list[CostRow]:
    """One row per run of a bench_prefill JSON. A tutti run holds C*h tokens' KV per session on
    SSD and writes the KV of its C*(1-h) new tokens (x the write amplification: given, else the
    format's with reuse); dram holds the prefix in DRAM and writes nothing to SSD."""
    shape = result["shape"]
    geometry = prefill_geometry(shape)
    kv_per_token = geometry.page_nbytes / geometry.page_size
    wa = write_amplification or format_write_amplification(geometry)
    runs = result["results"] + [x for m in result.get("media", {}).values() for x in m["runs"]]
    rows = []
    for x in runs:
        prefix_gb = x["C"] * x["h"] * kv_per_token / 1e9 * sessions
        tutti = x["config"].startswith("tutti")
        dram = prefix_gb if x["config"] == "dram" else 0.0
        tps = x["C"] / x["ttft_s"]
        written = 1e6 * (1.0 - x["h"]) * kv_per_token * wa if tutti else 0.0
        rows.append(CostRow(x["config"], x["C"], x["h"], tps,
                            cost_per_million(tps, gpus, dram, prefix_gb if tutti else 0.0,
                                             *prices),
                            written, endurance.per_million(written)))
    return rows


def measured_rate(stats: dict) -> tuple[float, Optional[float]]:
    """(physical bytes written per second, write amplification) of this session, from a
    tutti_stats_file's counters (the host tier's or the linker's)."""
    w = stats["wear"]
    seconds = w["seconds"]
    return (w["physical_bytes"] / seconds if seconds > 0 else 0.0), w["write_amplification"]


def table(rows: list[CostRow], endurance: Endurance, drives: float = 1.0) -> str:
    """The cost table; DWPD: each of `drives` drives' writes per day at the row's throughput."""
    e = endurance
    lines = [f"SSD wear: ${e.drive_usd:.0f} per {e.drive_tb:g} TB drive rated {e.dwpd:g} DWPD for "
             f"{e.warranty_years:g} years = ${e.usd_per_tb_written:.4f} per TB written; DWPD: "
             f"each of {drives:g} drive(s) at the row's throughput, sustained",
             f"{'config':<16} {'C':>7} {'h':>6} {'tokens/s':>12} {'$ per 1M tokens':>16} "
             f"{'GB written/1M':>14} {'DWPD':>7} {'wear $/1M':>10} {'total $/1M':>11}"]
    for r in rows:
        lines.append(f"{r.config:<16} {r.C:>7} {r.h:>6} {r.tokens_per_s:>12.0f} "
                     f"{r.usd_per_mtok:>16.4f} {r.written_bytes_per_mtok / 1e9:>14.3f} "
                     f"{e.dwpd_at(r.written_bytes_per_s, drives):>7.2f} "
                     f"{r.wear_usd_per_mtok:>10.4f} {r.total_usd_per_mtok:>11.4f}")
    return "\n".join(lines)
