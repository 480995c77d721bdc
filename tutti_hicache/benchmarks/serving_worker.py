"""A long-lived bench_serving process: SGLang's benchmark client imported once, then run once per
phase (its own command line, its own output file), so a phase does not pay the client's ~30 s of
imports (serving.Client starts it while the server starts).

    python -m tutti_hicache.benchmarks.serving_worker FD
        reads one JSON list per line on stdin: bench_serving's arguments (serving.argv without
        the interpreter and module); runs sglang.benchmark.serving's cli_main on them; writes
        "<exit code>\\n" to file descriptor FD when it has finished (0: its output file is
        written). Its own output (bench_serving's report) goes to stdout. An empty line ends it.

The tokenizer is loaded once per path (bench_serving loads it per run).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fd = int(argv[0])
    bs = importlib.import_module("sglang.benchmark.serving")
    bs.get_tokenizer = functools.lru_cache(maxsize=4)(bs.get_tokenizer)
    os.write(fd, b"ready\n")
    for line in sys.stdin:
        if not line.strip():
            break
        args = json.loads(line)
        sys.argv = ["sglang.benchmark.serving", *args]
        code = 0
        try:
            bs.cli_main()
        except SystemExit as e:  # argparse errors and explicit exits
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - reported as a failed phase; the worker goes on
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(fd, f"{code}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
