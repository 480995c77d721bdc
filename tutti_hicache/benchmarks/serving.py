"""SGLang's own client, `bench_serving` (python -m sglang.benchmark.serving), driving the e2e
phases: its generated-shared-prefix data set (--tokenize-prompt), its request pacing and its
report (TTFT mean/p50/p99, ITL, throughput, --cache-report), one subprocess per phase.

At a glance:
    Shape(groups, per_group, system, question, output, seed, zipf=0.0)   one data set
    write_tokenizer(model_dir, vocab)      a word-level tokenizer.json beside the model's config:
                                           bench_serving needs a vocabulary to draw prompts from,
                                           and the server one to stream text (the client's TTFT)
    prompts(shape, tokenizer_dir) -> [ids]  the prompts bench_serving sends, in its order
                                           (SGLang's own generator, in-process; it caches them
                                           where the client then reads them)
    argv(shape, url, tokenizer_dir, out_file, rate, concurrency, flush) -> [str]
    Client(log_path, cwd).start()          one bench_serving process for every phase (serving_worker)
    run(srv, shape, tokenizer_dir, out_file, ..., client=None) -> dict    its JSON line (details
                                           included); stops at once when the server process dies
    records(result, prompts, ids, cached) -> [record]          per request, in the harness's record
                                           format (e2e.summarize, the report tables)
    summary(result) -> dict                what it reports, under its own names

The data set: `groups` documents ("system prompts") of `system` tokens, each followed by questions
of `question` tokens (`per_group` per document; Zipf-popular documents with zipf > 0). SGLang draws
the documents first from the seed, so two shapes with the same seed, groups and system share
their documents whatever their per_group or zipf; the first question of each document is the
same too (its slot 0).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

from . import e2e

# bench_serving's JSON keys this harness reports (its own names), in the report's order
REPORTED = ("completed", "request_throughput", "input_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms",
            "p99_itl_ms", "mean_e2e_latency_ms", "duration")


@dataclass(frozen=True)
class Shape:
    groups: int        # documents
    per_group: int     # questions per document (slots: groups * per_group)
    system: int        # document tokens
    question: int      # question tokens
    output: int        # new tokens per request
    seed: int = 0
    zipf: float = 0.0  # > 0: each slot's document drawn by Zipf popularity with this alpha

    def __post_init__(self):
        if min(self.groups, self.per_group, self.system, self.question, self.output) < 1:
            raise ValueError(f"bench_serving shape needs positive sizes: {self}")
        if self.zipf < 0 or not math.isfinite(self.zipf):
            raise ValueError(f"zipf alpha must be a finite number >= 0: {self.zipf}")

    @property
    def requests(self) -> int:
        return self.groups * self.per_group

    def with_(self, **kw) -> "Shape":
        return replace(self, **kw)


def write_tokenizer(path: str, vocab: int) -> None:
    """tokenizer.json (word level: token i is "t<i>", split on spaces) and tokenizer_config.json
    in `path`. Ids are what the benchmark sends (--tokenize-prompt); the text exists only so the
    server streams text chunks, which is what bench_serving times."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, "tokenizer.json")
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(target + ".tmp")
    os.replace(target + ".tmp", target)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}, f)


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def prompts(shape: Shape, tokenizer_dir: str, tokenizer=None) -> list:
    """The token ids of every prompt bench_serving sends for `shape`, in sending order (the data
    set is generated ordered). Seeded as bench_serving seeds itself; SGLang caches the set under
    a key of these parameters, and the client then loads that same file."""
    import random

    import numpy as np
    from sglang.benchmark.datasets.generated_shared_prefix import \
        sample_generated_shared_prefix_requests
    random.seed(shape.seed)
    np.random.seed(shape.seed)
    rows = sample_generated_shared_prefix_requests(
        num_groups=shape.groups, prompts_per_group=shape.per_group, system_prompt_len=shape.system,
        question_len=shape.question, output_len=shape.output, range_ratio=1.0,
        tokenizer=tokenizer or _load_tokenizer(tokenizer_dir), seed=shape.seed, ordered=True,
        group_distribution="zipf" if shape.zipf else "uniform", zipf_alpha=shape.zipf or None,
        input_ids=True)
    return [list(r.prompt) for r in rows]


def argv(shape: Shape, url: str, tokenizer_dir: str, out_file: str, rate: float = math.inf,
         concurrency: int = 1, flush: bool = False, python: str = sys.executable) -> list:
    """bench_serving's command line for one phase: no warm-up request (the first request of a
    phase is measured: the first on an empty store, the first restore after a restart), the
    cache report, per-request details; --flush-cache empties the server's device cache first."""
    host, _, port = url.rpartition("//")[2].partition(":")
    cmd = [python, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", host,
           "--port", port, "--model", tokenizer_dir, "--tokenizer", tokenizer_dir,
           "--dataset-name", "generated-shared-prefix", "--tokenize-prompt", "--gsp-ordered",
           "--gsp-num-groups", str(shape.groups), "--gsp-prompts-per-group", str(shape.per_group),
           "--gsp-system-prompt-len", str(shape.system), "--gsp-question-len", str(shape.question),
           "--gsp-output-len", str(shape.output), "--seed", str(shape.seed),
           "--num-prompts", str(shape.requests), "--request-rate", "inf" if math.isinf(rate) else f"{rate:g}",
           "--max-concurrency", str(concurrency), "--warmup-requests", "0", "--cache-report",
           "--output-file", out_file, "--output-details", "--disable-tqdm"]
    if shape.zipf:
        cmd += ["--gsp-group-distribution", "zipf", "--gsp-zipf-alpha", f"{shape.zipf:g}"]
    if flush:
        cmd.append("--flush-cache")
    return cmd


OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class Client:
    """bench_serving in one long-lived process (serving_worker.py): its imports paid once, at
    start() (call it early: they overlap the server's start), not per phase. A phase that
    outlives its server or its time limit kills the process; the next phase starts another."""

    def __init__(self, log_path: str, cwd: Optional[str] = None, python: str = sys.executable,
                 module: str = "tutti_hicache.benchmarks.serving_worker"):
        self.log_path, self.cwd, self.python, self.module = log_path, cwd, python, module
        self.proc: Optional[subprocess.Popen] = None
        self._fd, self._buf, self._ready = -1, b"", False

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        r, w = os.pipe()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", self.module, str(w)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(w,),
                cwd=self.cwd, env={**os.environ, **OFFLINE}, text=True)
        os.close(w)
        self._fd, self._buf, self._ready = r, b"", False

    def _line(self, srv, deadline: float) -> str:
        """The worker's next status line; raises when the server or the worker died, or at the
        deadline (the worker is then killed)."""
        import select
        while b"\n" not in self._buf:
            if srv is not None and not srv.alive():
                self.close()
                raise RuntimeError("bench_serving stopped: the server process died")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("bench_serving stopped: out of time")
            ready, _, _ = select.select([self._fd], [], [], 0.2)
            if ready:
                chunk = os.read(self._fd, 4096)
                if not chunk:  # the worker is gone
                    code = self.proc.wait() if self.proc is not None else None
                    self.close()
                    raise RuntimeError(f"bench_serving's process exited ({code}; its output: "
                                       f"{self.log_path})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode().strip()

    def run(self, srv, args: list, timeout_s: float) -> int:
        """One bench_serving run with these arguments; its exit code."""
        deadline = time.monotonic() + timeout_s
        self.start()
        if not self._ready:
            if self._line(srv, deadline) != "ready":
                self.close()
                raise RuntimeError(f"bench_serving's process did not start (see {self.log_path})")
            self._ready = True
        with open(self.log_path, "a") as log:
            log.write("== bench_serving " + " ".join(args) + "\n")
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        return int(self._line(srv, deadline))

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            try:
                self.proc.stdin.close()
            except OSError:  # a pipe whose reader was killed
                pass
            self.proc = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def run(srv, shape: Shape, tokenizer_dir: str, out_file: str, rate: float = math.inf,
        concurrency: int = 1, flush: bool = False, timeout_s: float = 900.0,
        log_path: Optional[str] = None, client: Optional[Client] = None) -> dict:
    """One bench_serving phase against `srv` (benchmarks.server.Server); its JSON line with the
    per-request details. In `client` (one process for every phase) or else a process of its
    own; either is killed when the server process dies or after timeout_s, and the phase then
    raises (the harness records the error and goes on)."""
    if os.path.exists(out_file):
        os.unlink(out_file)  # bench_serving appends
    cmd = argv(shape, srv.url, tokenizer_dir, out_file, rate, concurrency, flush)
    if client is not None:
        code = client.run(srv, cmd[3:], timeout_s)
    else:
        code = _run_process(srv, cmd, timeout_s, log_path)
    if code != 0 or not os.path.exists(out_file):
        where = client.log_path if client is not None else log_path
        raise RuntimeError(f"bench_serving exited with {code}" + (f" (its output: {where})" if where else ""))
    with open(out_file) as f:
        lines = [ln for ln in f if ln.strip()]
    return json.loads(lines[-1])


def _run_process(srv, cmd: list, timeout_s: float, log_path: Optional[str]) -> int:
    log = open(log_path, "a") if log_path else subprocess.DEVNULL
    try:
        if log_path:
            log.write("== " + " ".join(cmd) + "\n")
            log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE})
        t0 = time.monotonic()
        while proc.poll() is None:
            if not srv.alive() or time.monotonic() - t0 > timeout_s:
                proc.kill()
                proc.wait()
                why = "the server process died" if not srv.alive() else f"over {timeout_s:g} s"
                raise RuntimeError(f"bench_serving stopped: {why}")
            time.sleep(0.2)
        return proc.returncode
    finally:
        if log_path:
            log.close()


def records(result: dict, prompts_ids: list, ids: list, cached: list) -> list:
    """bench_serving's per-request details as the harness's records (e2e module docstring), in
    sending order: id, prompt tokens, TTFT, inter-token gaps, SGLang's cached tokens and their
    per-tier split. prompts_ids: the prompts sent (their lengths are checked against the
    client's); cached: the tokens a warmed store holds of each (page-aligned document)."""
    n = len(result.get("ttfts", []))
    if n != len(prompts_ids):
        raise ValueError(f"bench_serving reported {n} requests, the data set has {len(prompts_ids)}")
    sent = result.get("input_lens") or [len(p) for p in prompts_ids]
    if [int(x) for x in sent] != [len(p) for p in prompts_ids]:
        raise ValueError("bench_serving sent other prompts than the harness generated "
                         "(its cached data set is stale: remove ~/.cache/sglang/benchmark)")
    out = []
    errors = result.get("errors") or [""] * n
    details = result.get("cached_tokens_details") or [None] * n
    ctoks = result.get("cached_tokens") or [0] * n
    for i in range(n):
        ttft = result["ttfts"][i]
        rec = {"id": ids[i], "prompt_tokens": len(prompts_ids[i]), "cached": cached[i],
               "ttft_s": ttft if ttft and not errors[i] else None,
               "itl_s": list(result.get("itls", [[]] * n)[i] or []),
               "cached_tokens": ctoks[i] or 0, "details": details[i]}
        if errors[i]:
            rec["error"] = str(errors[i])[-300:]
        out.append(rec)
    return out


def summary(result: dict) -> dict:
    """What bench_serving reports for a phase, under its own names, and its cache report."""
    out = {k: result.get(k) for k in REPORTED if k in result}
    if result.get("cache_report"):
        out["cache_report"] = result["cache_report"]
    return out


def highest_rate(points: dict, slo_s: float = 1.0) -> Optional[float]:
    """{rate: mean TTFT s (None: failed)} -> the highest rate whose mean TTFT is under slo_s with
    every lower rate under it too (a sweep's breaking point), or None."""
    best = None
    for rate in sorted(points):
        ttft = points[rate]
        if ttft is None or ttft >= slo_s:
            break
        best = rate
    return best


def gsp_ids(prefix: str, shape: Shape) -> list:
    """Stable request ids of a shape's slots ("gsp/32768/3": document 3's question 0), the keys
    the output check compares by across configurations. Zipf shapes number slots in order."""
    if shape.zipf:
        return [f"{prefix}/{shape.system}/{k}" for k in range(shape.requests)]
    return [f"{prefix}/{shape.system}/{g}" + (f".{p}" if p else "")
            for g in range(shape.groups) for p in range(shape.per_group)]


def check_requests(shape: Shape, all_prompts: list, page: int = e2e.PAGE) -> list:
    """The output check's requests: a uniform shape's prompts sent again (e2e.Request; cached =
    the prompt's whole pages of `page` tokens short of its last token, which the warm phase
    stored)."""
    return [e2e.Request(rid, list(ids), shape.system, (len(ids) - 1) // page * page)
            for rid, ids in zip(gsp_ids("gsp", shape), all_prompts)]
