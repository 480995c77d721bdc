"""The end-to-end server benchmark's pure parts: workload, summaries and report tables.

At a glance:
    wl = Workload(contexts=(16384, 32768, 65536), docs=2)
    wl.warm() / wl.first() / wl.sweep(fractions) / wl.rates(rate, n) / wl.capacity_warm(n_docs, C)
        / wl.capacity_reuse(n_docs, C, n)   -> [Request]   (seeded token ids, no data set)
    summarize(records, seconds) -> dict                    TTFT mean/p50/p99, ITL, throughput, cached tokens
    outputs_vs(runs, ref="recompute", tol) -> {run_key(run): {phase: {compared, equal, max_logprob_diff,
                                                  mismatches}}}   greedy ids and top-k logprobs
    compare_output(got, want, tol) -> (equal, logprob difference)   one request against its reference
    position_diff({token: logprob}, {token: logprob}) -> float     one position's top-k difference
    sweep_requests(wl, fractions) -> [Request]             each sweep point and its compute-only twin
The report's tables are in e2e_report.py, the server configurations in configs.py.

The workload is LEval/LooGLE-shaped: documents of C tokens (a shared 256-token system prompt, then
the document) asked short questions. Request ids are stable across configurations, so the outputs
of one configuration are compared with the same prompt's recomputed output (config `recompute`).
A sweep request keeps the first h*C tokens of a warmed document (page-aligned: what a store can
hold) and fills the rest of its C tokens with new ones, so h is the cached share of the prompt.

A run (what bench/e2e_sglang.py writes, one dict per configuration and medium):
    {"config", "medium", "raw_read_GBps", "phases": {phase: [record]}, ...}
    record = {"id", "ttft_s", "itl_s": [...], "e2e_s", "cached_tokens", "details", "output_ids",
              "top_logprobs": [[[logprob, token id]] * k per output position] (when asked)}
Pure: numpy only, no server, no GPU (tested on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

PAGE = 64
SYSTEM_TOKENS = 256
TOKEN_RANGE = (100, 30000)


@dataclass(frozen=True)
class Request:
    id: str            # stable across configurations (the output comparison key)
    ids: list          # prompt token ids
    context: int       # document size in tokens (C)
    cached: int        # leading tokens a warmed store holds for this prompt (page-aligned)

    @property
    def hit_fraction(self) -> float:
        return self.cached / len(self.ids)


class Workload:
    """Seeded documents and questions. `docs` documents per context; questions of `q_tokens`;
    `page`: the server's --page-size, to which cached prefixes are cut.
    salt != 0 changes every token that follows a document (questions, a sweep point's new
    tokens, its twin's), never the documents: a second configuration on a store the first one
    wrote then asks nothing that store already holds past the documents."""

    def __init__(self, contexts: Iterable[int] = (16384, 32768, 65536), docs: int = 2,
                 q_tokens: int = 96, seed: int = 0, salt: int = 0, page: int = PAGE):
        self.contexts = tuple(int(c) for c in contexts)
        if page < 1:
            raise ValueError(f"page: a positive number of tokens, got {page}")
        self.page = int(page)
        if any(c <= SYSTEM_TOKENS + self.page for c in self.contexts):
            raise ValueError(f"contexts must exceed {SYSTEM_TOKENS + self.page} tokens: {self.contexts}")
        self.docs, self.q_tokens, self.seed, self.salt = int(docs), int(q_tokens), int(seed), int(salt)
        self.system = self.tokens("system", SYSTEM_TOKENS)

    def tokens(self, tag: str, n: int, *key: int) -> list:
        """n seeded token ids; the same (seed, tag, key) always gives the same ids (and the salt,
        for every tag but the system prompt's and the documents')."""
        words = [self.seed, sum(map(ord, tag)) * 7919 + len(tag), *key]
        if self.salt and tag not in ("system", "doc", "cap"):
            words.append(1_000_003 * self.salt)
        return np.random.default_rng(words).integers(*TOKEN_RANGE, n).tolist()

    def document(self, context: int, d: int, tag: str = "doc") -> list:
        """The shared system prompt and document d of size `context` (tokens in all)."""
        return self.system + self.tokens(tag, context - SYSTEM_TOKENS, context, d)

    def _question(self, *key: int) -> list:
        return self.tokens("question", self.q_tokens, *key)

    def rid(self, name: str) -> str:
        """A request id; with a salt, its first part says so ("sweep~s1/32768/0.9"): salted
        prompts differ from unsalted ones under the same name, so ids must too."""
        if not self.salt:
            return name
        head, _, rest = name.partition("/")
        return f"{head}~s{self.salt}/{rest}" if rest else f"{head}~s{self.salt}"

    def _ask(self, rid: str, doc: list, context: int, *key: int) -> Request:
        return Request(self.rid(rid), doc + self._question(*key), context, len(doc) // self.page * self.page)

    def warm(self) -> list:
        """Each document once (first seen: computed, its KV written to the tier)."""
        return [self._ask(f"warm/{c}/{d}", self.document(c, d), c, c, d, 0)
                for c in self.contexts for d in range(self.docs)]

    def first(self) -> Request:
        """The first request after a restart: the largest context's first document, a new question."""
        c = max(self.contexts)
        return self._ask(f"first/{c}/0", self.document(c, 0), c, c, 0, 1)

    def sweep(self, fractions: Iterable[float]) -> list:
        """Per context and hit fraction h: the first h*C tokens of a warmed document (documents
        taken in turn), then new tokens up to C in all, then a question."""
        out = []
        for c in self.contexts:
            for i, h in enumerate(fractions):
                if not 0 < h < 1:
                    raise ValueError(f"hit fractions must lie in (0, 1): {h}")
                d = i % self.docs
                keep = int(h * c) // self.page * self.page
                fresh = self.tokens("fresh", c - keep, c, d, int(round(h * 1000)))
                ids = self.document(c, d)[:keep] + fresh
                out.append(Request(self.rid(f"sweep/{c}/{h:g}"), ids + self._question(c, d, 2, i), c, keep))
        return out

    def rates(self, rate: float, n: int) -> list:
        """n questions on warmed documents of every context, in a seeded random order."""
        rng = np.random.default_rng([self.seed, 17, int(rate * 1000)])
        pairs = [(c, d) for c in self.contexts for d in range(self.docs)]
        out = []
        for k in range(n):
            c, d = pairs[int(rng.integers(len(pairs)))]
            out.append(self._ask(f"rate{rate:g}/{k}", self.document(c, d), c, c, d, 1000 + k))
        return out

    def capacity_warm(self, n_docs: int, context: int) -> list:
        return [self._ask(f"capwarm/{context}/{d}", self.document(context, d, "cap"), context,
                          context, d, 0) for d in range(n_docs)]

    def capacity_reuse(self, n_docs: int, context: int, n: int) -> list:
        """n reuses of the capacity documents in a seeded random order (without repeats while
        n <= n_docs), each with a new question."""
        order = np.random.default_rng([self.seed, 29]).permutation(n_docs).tolist()
        order = (order * (n // max(1, n_docs) + 1))[:n]
        return [self._ask(f"cap/{context}/{k}", self.document(context, d, "cap"), context,
                          context, d, 2000 + k) for k, d in enumerate(order)]


def bytes_per_token(layers: int, kv_heads: int = 8, head_dim: int = 128, dtype_bytes: int = 2) -> int:
    """KV bytes of one token (K and V of every layer): Llama-3-8B at 32 layers is 128 KiB."""
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def _pct(a, q):
    return float(np.percentile(a, q)) if len(a) else None


def summarize(records: list, seconds: Optional[float] = None) -> dict:
    """TTFT mean/p50/p99 and ITL in ms, requests/s, SGLang's cached tokens (mean, and by tier)."""
    recs = [r for r in records if r.get("ttft_s") is not None]
    ttft = np.array([r["ttft_s"] for r in recs]) * 1e3
    itl = np.array([x for r in recs for x in r.get("itl_s", [])]) * 1e3
    tiers = {}
    for r in recs:
        for k, v in (r.get("details") or {}).items():
            if isinstance(v, (int, float)):
                tiers[k] = tiers.get(k, 0) + v
    out = {"requests": len(records), "failed": len(records) - len(recs),
           "ttft_mean_ms": float(ttft.mean()) if len(ttft) else None,
           "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
           "itl_mean_ms": float(itl.mean()) if len(itl) else None,
           "cached_tokens_mean": float(np.mean([r.get("cached_tokens", 0) for r in recs])) if recs else None,
           "cached_by_tier_mean": {k: v / len(recs) for k, v in tiers.items()} if recs else {}}
    if seconds:
        out["throughput_rps"] = len(recs) / seconds
    return out


def model_key(run: dict) -> tuple:
    """What a run's outputs and timings belong to beyond its configuration and medium: the model
    shape, layers, KV dtype, weights and page size its server ran (None for fields a run from
    before they were recorded lacks: such runs keep matching each other)."""
    return tuple(run.get(k) for k in ("model_shape", "layers", "kv_cache_dtype", "weights", "page_size"))


def run_key(run: dict) -> str:
    """The key outputs_vs files a run's check under: config@medium, then |model_key when the run
    records its model, so two models' runs of one configuration on one medium keep a check each
    (a report rebuilt from several calls' files holds both)."""
    key = f"{run['config']}@{run.get('medium', '')}"
    mk = model_key(run)
    return key if all(x is None for x in mk) else key + "|" + "/".join("" if x is None else str(x) for x in mk)


def _by_id(run: dict) -> dict:
    return {r["id"]: r for recs in run.get("phases", {}).values() for r in recs}


LOGPROB_TOL = 0.2  # see compare_output


def position_diff(a: dict, b: dict) -> float:
    """The largest top-k logprob difference at one position ({token: logprob} each). A token in
    one top-k and not the other counts by how far it stands above the other's k-th logprob (a
    near tie at the boundary costs its gap, a real change its size)."""
    worst = 0.0
    for x, y in ((a, b), (b, a)):
        floor = min(y.values())
        for t, lp in x.items():
            worst = max(worst, abs(lp - y[t]) if t in y else max(0.0, lp - floor))
    return worst


def top_logprob_diff(got: dict, want: dict):
    """The largest top-k logprob difference over the positions both generations share a history
    for, or None when either lacks the logprobs of a position it generated. Where the greedy ids part, the position is compared and the walk stops: later
    positions continue different tokens. A parting is only allowed as a near tie (checked by
    compare_output): each side's token within tol of the other's top-1 in the other's top-k."""
    ids_a, ids_b = got.get("output_ids") or [], want.get("output_ids") or []
    tops_a, tops_b = got.get("top_logprobs") or [], want.get("top_logprobs") or []
    if len(tops_a) != len(ids_a) or len(tops_b) != len(ids_b) or not ids_a or not ids_b:
        return None
    worst = 0.0
    for ta, tb, pa, pb in zip(ids_a, ids_b, tops_a, tops_b):
        da, db = {int(t): float(lp) for lp, t in pa}, {int(t): float(lp) for lp, t in pb}
        if not da or not db:
            return None
        worst = max(worst, position_diff(da, db))
        if ta != tb:
            break
    return worst


def _near_tie(got: dict, want: dict, tol: float) -> bool:
    """Whether the first position where the greedy ids part is a near tie on both sides."""
    for i, (ta, tb) in enumerate(zip(got["output_ids"], want["output_ids"])):
        if ta != tb:
            da = {int(t): float(lp) for lp, t in got["top_logprobs"][i]}
            db = {int(t): float(lp) for lp, t in want["top_logprobs"][i]}
            return tb in da and ta in db and da[ta] - da[tb] <= tol and db[tb] - db[ta] <= tol
    return len(got["output_ids"]) == len(want["output_ids"])


def compare_output(got: dict, want: dict, tol: float = LOGPROB_TOL) -> tuple:
    """(equal, logprob difference or None) of one request's output against the reference's.
    Without top-k logprobs on either side: equal = the same greedy ids. With them: every
    position's top-k within tol up to and including the first position where the greedy ids
    part, and a parting only where it is a near tie (the two tokens within tol of each other on
    both sides); logprobs on one side only, or missing for a position, are no match.

    Why a parting may pass, and why 0.2: restore and recompute hold the same KV up to bf16
    rounding (recompute prefills in other chunks, its sums run in another order), and with
    random weights the top logits of a 128K vocabulary lie close together, so rounding alone
    can swap the greedy token. On the CPU (bench/output_margin.py: transformers' Llama, this
    init, fp32 logits from bf16 hidden states, one prefill against a cached prefix + extend; not
    a GPU result) that rounding moved top-5 logprobs by up to 0.019 at 2 layers and 0.053 at 8
    layers (4K context), where one page (64 of 4096 tokens) of another document's KV moved them
    by 0.87 (2 layers) and 1.26 (8 layers). The GPU run's max logprob difference per phase
    shows both sides of the margin there."""
    ids_equal = got.get("output_ids") == want.get("output_ids")
    if not got.get("top_logprobs") and not want.get("top_logprobs"):
        return ids_equal, None
    diff = top_logprob_diff(got, want)
    if diff is None:
        return False, None
    return diff <= tol and (ids_equal or _near_tie(got, want, tol)), diff


def outputs_vs(runs: list, ref: str = "recompute", tol: float = LOGPROB_TOL) -> dict:
    """Per run (run_key: configuration, medium, model) and phase, every request with the reference configuration's output
    for the same id on the same model (model_key: shape, layers, KV dtype, weights, page size;
    same medium or any medium: outputs do not depend on the medium) compared by compare_output:
    {"compared", "equal", "with_logprobs" (compared on logprobs too), "max_logprob_diff" (None
    without logprobs), "mismatches": [ids]}. A request with no reference on its model is not
    compared: an fp8 run is never held against a bf16 recompute."""
    refs = {}
    for run in runs:
        if run.get("config") == ref:
            mk = model_key(run)
            refs.update({(mk, k): r for k, r in _by_id(run).items() if r.get("output_ids") is not None})
    out = {}
    for run in runs:
        if run.get("config") == ref:
            continue
        per, mk = {}, model_key(run)
        for phase, recs in run.get("phases", {}).items():
            row = {"compared": 0, "equal": 0, "with_logprobs": 0, "max_logprob_diff": None, "mismatches": []}
            for r in recs:
                want = refs.get((mk, r["id"]))
                if want is None or r.get("output_ids") is None:
                    continue
                equal, diff = compare_output(r, want, tol)
                row["compared"] += 1
                row["equal"] += equal
                if not equal:
                    row["mismatches"].append(r["id"])
                if diff is not None:
                    row["with_logprobs"] += 1
                    row["max_logprob_diff"] = max(diff, row["max_logprob_diff"] or 0.0)
            per[phase] = row
        out[run_key(run)] = per
    return out


def output_ids(chunks: list) -> list:
    """Cumulative chunks (each extends the last): the last; incremental ones: their concatenation."""
    if all(chunks[i] == chunks[i + 1][: len(chunks[i])] for i in range(len(chunks) - 1)):
        return chunks[-1] if chunks else []
    return [t for c in chunks for t in c]


def sweep_requests(wl: Workload, fractions: list) -> list:
    """Interleaved over contexts (so a document comes back only after every other context's
    documents have passed through the device pool), each point followed by its compute-only twin:
    the same cached prefix, new tokens of the same length, while the prefix is in device memory."""
    pts = wl.sweep(fractions)
    by = {(r.context, r.id.split("/")[2]): r for r in pts}
    out = []
    for h in fractions:
        for c in wl.contexts:
            r = by[(c, f"{h:g}")]
            twin_tail = wl.tokens("twin", len(r.ids) - r.cached, c, int(round(h * 1000)))
            out += [r, Request(r.id + "/l1", r.ids[: r.cached] + twin_tail, c, r.cached)]
    return out


def extend_sizes(sweep: list) -> list:
    """The distinct numbers of new tokens (after the cached prefix) of a sweep's requests, sorted."""
    return sorted({len(r.ids) - r.cached for r in sweep})
