"""End to end on a real SGLang server (0.5.17-0.5.23, a GPU): tutti vs `file` vs no storage tier.

Per configuration one server start writes (phase "warm": each document's first question misses,
the next ones hit the device cache; then each document's first question again, as an L1 hit: the
reference outputs), waits until the storage tier stops growing, and stops; a second server start
over the same directory, after a page-cache drop, reads (phase "cold": one request per document,
one after another, so hits can only come from the storage tier). Config `none` (no storage tier)
runs only the cold phase on a fresh server: the recompute baseline. Workload (seeded token ids, no
dataset): D long documents (a shared system prompt + document, `--context` tokens) each asked Q
questions (LEval/LooGLE-like multi-turn over one document), sent at a fixed rate. Reported per
(config, phase): TTFT mean/p50/p99, ITL, request throughput, cached tokens per request (SGLang's
meta_info), SGLang's storage metrics, tutti's stats file (bytes, seconds, checksum failures) and
restore GB/s, the medium's raw O_DIRECT read, and whether the cold outputs equal the L1-hit ones.
SGLang's `file` backend is pointed at the medium through SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.

  python bench/e2e_sglang.py --model /tmp/llama8 --medium disk=/var/tmp/tutti-e2e \
      --configs none,file,tutti,tutti-plugin --json out.json

A model directory needs only a config.json (`--write-model` writes a Llama-3-8B-width one with
`--layers` layers); the server loads random weights (--load-format dummy --skip-tokenizer-init).
No GPU in CI: this script is not a test (see tests/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np

LLAMA_WIDTH = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
               "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 32000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
               "rope_theta": 500000.0, "torch_dtype": "bfloat16", "hidden_act": "silu",
               "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def write_model(path: str, layers: int) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(LLAMA_WIDTH, num_hidden_layers=layers), f)


def workload(docs: int, questions: int, context: int, seed: int = 0) -> list:
    """[(doc, question, token ids)]: a shared system prompt + document, then a short question."""
    rng = np.random.default_rng(seed)
    system = rng.integers(100, 30000, 256).tolist()
    out = []
    for d in range(docs):
        doc = rng.integers(100, 30000, context - 256).tolist()
        for q in range(questions):
            out.append((d, q, system + doc + rng.integers(100, 30000, 96).tolist()))
    return out


def server_cmd(args, config: str, medium_dir: str, port: int) -> list:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
           "--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend", "triton",
           "--sampling-backend", "pytorch", "--disable-cuda-graph", "--page-size", "64",
           "--mem-fraction-static", "0.5", "--port", str(port), "--enable-metrics",
           "--enable-hierarchical-cache", "--hicache-size", str(args.hicache_gb),
           "--hicache-mem-layout", "layer_first", "--hicache-write-policy", "write_through",
           "--hicache-storage-prefetch-policy", "wait_complete"]
    if args.deterministic:
        cmd.append("--enable-deterministic-inference")
    tutti = {"tutti_dirs": [os.path.join(medium_dir, "tutti")], "tutti_capacity_gb": args.capacity_gb,
             "tutti_stats_file": os.path.join(args.out_dir, f"stats-{config}-{{pid}}.json")}
    if config == "file":
        cmd += ["--hicache-storage-backend", "file"]  # its directory: server_env()
    elif config == "tutti":
        extra = {"backend_name": "tutti", "module_path": "tutti_hicache.storage",
                 "class_name": "TuttiStorage", "interface_v1": 1, **tutti}
        cmd += ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra)]
    elif config == "tutti-plugin":
        cmd += ["--hicache-storage-backend", "tutti", "--hicache-storage-backend-extra-config", json.dumps(tutti)]
    return cmd


def server_env(config: str, medium_dir: str) -> dict:
    """SGLang's `file` backend takes its directory only from this variable (the extra config's
    file_storage_path is ignored by 0.5.17-0.5.23's factory): point it at the medium under test."""
    env = dict(os.environ)
    env.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    if config == "file":
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = os.path.join(medium_dir, "file")
    return env


class Server:
    def __init__(self, cmd: list, log_path: str, port: int, env: dict):
        self.port = port
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float) -> float:
        import requests
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} (see {self.log.name})")
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    return time.time() - t0
            except Exception:
                pass
            time.sleep(1)
        raise TimeoutError("server did not start")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def one_request(url: str, ids: list, max_new: int) -> dict:
    """Stream one greedy generation: TTFT, inter-token latencies, cached tokens, output ids."""
    import requests
    t0 = time.perf_counter()
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    ttft, stamps, last = None, [], {}
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            ttft = ttft if ttft is not None else now - t0
            stamps.append(now)
            last = json.loads(line[5:])
    meta = last.get("meta_info", {})
    return {"ttft_s": ttft, "itl_s": list(np.diff(stamps)), "cached_tokens": meta.get("cached_tokens", 0),
            "output_ids": last.get("output_ids"), "e2e_s": time.perf_counter() - t0}


def run_phase(url: str, reqs: list, rate: float, max_new: int) -> list:
    """At a fixed rate (rate > 0), or one after another (rate == 0: clean TTFT, and the same
    batch composition for every run, so greedy outputs can be compared across runs)."""
    if rate <= 0:
        return [one_request(url, ids, max_new) for _, _, ids in reqs]
    out, threads = [None] * len(reqs), []
    for i, (_, _, ids) in enumerate(reqs):
        t = threading.Thread(target=lambda i=i, ids=ids: out.__setitem__(i, one_request(url, ids, max_new)))
        t.start()
        threads.append(t)
        time.sleep(1.0 / rate)
    for t in threads:
        t.join()
    return out


def summarize(results: list, seconds: float) -> dict:
    ttft = np.array([r["ttft_s"] for r in results]) * 1e3
    itl = np.array([x for r in results for x in r["itl_s"]]) * 1e3
    return {"requests": len(results), "ttft_mean_ms": float(ttft.mean()),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "itl_mean_ms": float(itl.mean()) if len(itl) else None,
            "throughput_rps": len(results) / seconds,
            "cached_tokens_mean": float(np.mean([r["cached_tokens"] for r in results]))}


def scrape_metrics(url: str) -> list:
    """SGLang's storage counters from /metrics (prefetch/backup pages, bandwidth), as text lines."""
    import requests
    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except Exception as e:
        return [f"unavailable: {e}"]
    return [line for line in text.splitlines() if not line.startswith("#")
            and any(k in line for k in ("prefetch", "backup", "cached_tokens", "hicache"))]


def raw_read(directory: str, nbytes: int = 2 << 30) -> float:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tutti_hicache.bench_store import raw_read_GBps, write_raw_file
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "raw-e2e.bin")
    write_raw_file(path, nbytes)
    drop_caches()
    rate = max(raw_read_GBps(path, nbytes, 8 << 20, n) for n in (1, 8))
    os.unlink(path)
    return rate


def drop_caches() -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError as e:
        return f"not dropped ({e.strerror})"


def storage_written(config: str, medium_dir: str, out_dir: str) -> int:
    """Bytes the storage tier holds or has written so far (to wait for write-backs to finish)."""
    if config.startswith("tutti"):
        total = 0
        for p in os.listdir(out_dir):
            if p.startswith(f"stats-{config}-") and p.endswith(".json"):
                try:
                    total += json.load(open(os.path.join(out_dir, p))).get("write_bytes", 0)
                except (OSError, ValueError):
                    pass
        return total
    total = 0
    for root, _, files in os.walk(os.path.join(medium_dir, "file")):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def settle(config: str, medium_dir: str, out_dir: str, quiet_s: float = 4.0, limit_s: float = 60.0) -> float:
    """Wait until the storage tier's written bytes stop growing (SGLang backs up asynchronously)."""
    t0 = last_change = time.time()
    last = storage_written(config, medium_dir, out_dir)
    while time.time() - last_change < quiet_s and time.time() - t0 < limit_s:
        time.sleep(0.5)
        now = storage_written(config, medium_dir, out_dir)
        if now != last:
            last, last_change = now, time.time()
    return time.time() - t0


def run_config(args, config: str, medium: str, medium_dir: str, reqs: list) -> dict:
    """One server start writes (phase warm) then repeats the cold prompts as L1 hits (reference
    outputs); a restart plus a page-cache drop, then phase cold reads them from the storage tier.
    Config `none` has no storage tier: a single fresh start runs the cold prompts (recompute)."""
    port = 30000 + abs(hash((config, medium))) % 1000
    shutil.rmtree(medium_dir, ignore_errors=True)
    os.makedirs(medium_dir, exist_ok=True)
    log = os.path.join(args.out_dir, f"server-{config}-{medium}.log")
    res = {"config": config, "medium": medium}
    cold = [r for r in reqs if r[1] == 0]  # one request per document
    phases = [("cold", cold)] if config == "none" else [("warm", reqs), ("cold", cold)]
    for phase, batch in phases:
        srv = Server(server_cmd(args, config, medium_dir, port), log, port, server_env(config, medium_dir))
        try:
            res[f"{phase}_start_s"] = srv.wait_ready(args.start_timeout)
            if phase == "cold":
                res["page_cache"] = drop_caches()
            t0 = time.time()
            out = run_phase(srv.url, batch, args.rate if phase == "warm" else 0, args.max_new)
            res[phase] = summarize(out, time.time() - t0)
            res[f"{phase}_outputs"] = {f"{d}:{q}": o["output_ids"] for (d, q, _), o in zip(batch, out)}
            res[f"{phase}_cached_tokens"] = [o["cached_tokens"] for o in out]
            if phase == "warm":
                ref = run_phase(srv.url, cold, 0, args.max_new)  # same prompts, now L1 hits
                res["l1_ref"] = summarize(ref, 1.0)
                res["l1_ref_outputs"] = {f"{d}:{q}": o["output_ids"] for (d, q, _), o in zip(cold, ref)}
                res["settle_s"] = settle(config, medium_dir, args.out_dir)
            res[f"{phase}_metrics"] = scrape_metrics(srv.url)
        finally:
            srv.stop()
    if "l1_ref_outputs" in res:
        ref = res["l1_ref_outputs"]
        res["outputs_equal_l1_run"] = all(ref.get(k) == v for k, v in res["cold_outputs"].items())
        res["outputs_equal_count"] = sum(ref.get(k) == v for k, v in res["cold_outputs"].items())
    stats = sorted(p for p in os.listdir(args.out_dir) if p.startswith(f"stats-{config}-"))
    res["tutti_stats"] = [json.load(open(os.path.join(args.out_dir, p))) for p in stats]
    for p in stats:  # the next medium's run starts from zero
        os.replace(os.path.join(args.out_dir, p), os.path.join(args.out_dir, f"done-{medium}-{p}"))
    if res["tutti_stats"]:
        rb = sum(s.get("read_bytes", 0) for s in res["tutti_stats"])
        rs = sum(s.get("read_seconds", 0.0) for s in res["tutti_stats"])
        res["restore_GBps"] = rb / rs / 1e9 if rs else None
        res["checksum_failures"] = sum(s.get("checksum_failures", 0) for s in res["tutti_stats"])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8")
    ap.add_argument("--write-model", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--medium", action="append", required=True, help="NAME=dir")
    ap.add_argument("--configs", default="none,file,tutti")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--hicache-gb", type=int, default=8)
    ap.add_argument("--capacity-gb", type=float, default=32.0)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="skip configurations that would start after this many seconds (0: none)")
    ap.add_argument("--min-left-s", type=float, default=170, help="time one configuration needs")
    ap.add_argument("--out-dir", default="/tmp/tutti-e2e")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    for p in os.listdir(args.out_dir):  # stats of an earlier invocation are not this run's
        if p.startswith(("stats-", "done-")):
            os.unlink(os.path.join(args.out_dir, p))
    if args.write_model:
        write_model(args.model, args.layers)
    reqs = workload(args.docs, args.questions, args.context)
    results, t_start = [], time.time()
    for spec in args.medium:
        name, d = spec.split("=", 1)
        raw = raw_read(d)
        for config in args.configs.split(","):
            need = args.min_left_s / 2 if config == "none" else args.min_left_s  # one start, not two
            if args.deadline_s and time.time() - t_start + need > args.deadline_s:
                print(f"skipped {config} on {name}: out of time", flush=True)
                results.append({"config": config, "medium": name, "skipped": "out of time"})
                continue
            try:
                r = run_config(args, config, name, d, reqs)
            except Exception as e:  # keep what the other configurations measured
                r = {"config": config, "medium": name, "error": repr(e)}
            r["raw_read_GBps"] = raw
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if not k.endswith("outputs")}, default=str), flush=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
