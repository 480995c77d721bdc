"""The sanitizer builds see what the kernel does with our memory (scripts/sanitize.sh).

The io_uring engine's buffers are written and read by the kernel, which no sanitizer observes; the
hooks of cpp/include/tutti/detail/kernel_access.hpp report those accesses to them (the POSIX
engine's preadv/pwritev are intercepted by the sanitizers themselves). Each test runs a small
program with a deliberate bug in a child process, under the same preloaded runtime and module,
and checks the sanitizer reported it: without the hooks the io_uring cases would pass silently.
These tests run only against a sanitizer build (TUTTI_EXTENSION, as scripts/sanitize.sh sets it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tutti_hicache.engine import extension

SANITIZER = extension().SANITIZER
KINDS = ["uring", "posix"] if extension().uring_compiled() else ["posix"]

# A read into memory freed a moment before: the read must be refused before it is issued.
READ_INTO_FREED = """
import sys
import numpy as np
from tutti_hicache.engine import open_engine
e = open_engine(sys.argv[1])
f = e.open_file(sys.argv[2], False, False)
a = np.empty(1 << 16, np.uint8)  # numpy's buffer: from malloc, i.e. ASan's allocator
addr = a.ctypes.data
del a
e.submit("read", np.array([f]), np.array([0]), np.array([4096]), np.array([addr], np.uint64))
print("NOT REPORTED")
"""

# A read into a buffer another thread copies from at the same time, without synchronisation.
READ_RACING_A_COPY = """
import sys, threading
import numpy as np
from tutti_hicache.engine import extension, open_engine
E = extension()
e = open_engine(sys.argv[1], threads=1)
n = 16
f = e.open_file(sys.argv[2], False, False)
src, dst = E.AlignedBuffer(n * 4096), E.AlignedBuffer(n * 4096)
offs = np.arange(n) * 4096
lens = np.full(n, 4096)
def copies():
    for _ in range(300):
        E.memcpy_batch(dst.address + offs.astype(np.uint64), src.address + offs.astype(np.uint64), lens)
t = threading.Thread(target=copies)
t.start()
for _ in range(300):
    e.submit("read", np.full(n, f), offs, lens, src.address + offs.astype(np.uint64))
t.join()
print("NOT REPORTED")
"""


def _child_env(options_var: str) -> dict:
    """The parent's environment, with the sanitizer's report on stderr instead of a log file."""
    env = dict(os.environ)
    opts = [o for o in env.get(options_var, "").split(":") if o and not o.startswith("log_path=")]
    env[options_var] = ":".join(opts + ["halt_on_error=1"])
    return env


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(16 * 4096))
    return str(path)


# Per build: the bug, the runtime's options variable, what every report must say, and what the
# io_uring engine's must say besides (where the hook saw the kernel's access).
BUGS = {
    "address": (READ_INTO_FREED, "ASAN_OPTIONS",
                [r"ERROR: AddressSanitizer: heap-use-after-free", r"WRITE of size \d+"],
                r"#[0-2] 0x[0-9a-f]+ in prep \S*uring_engine\.cpp"),  # before the kernel had it
    "thread": (READ_RACING_A_COPY, "TSAN_OPTIONS",
               [r"WARNING: ThreadSanitizer: data race", r"memcpy_batch"], r"kernel_access"),
}


@pytest.mark.skipif(SANITIZER is None, reason="needs a sanitizer build (scripts/sanitize.sh)")
@pytest.mark.parametrize("kind", KINDS)
def test_the_sanitizer_reports_a_deliberate_bug(kind, data_file):
    """address: a read into freed memory; thread: a read racing a copy of its buffer."""
    program, options_var, every, uring_only = BUGS[SANITIZER]
    out = subprocess.run([sys.executable, "-c", program, kind, data_file], capture_output=True,
                         text=True, env=_child_env(options_var), timeout=240)
    assert out.returncode != 0 and "NOT REPORTED" not in out.stdout, out.stdout + out.stderr
    for pattern in every + ([uring_only] if kind == "uring" else []):
        assert re.search(pattern, out.stderr), f"{pattern!r} not in:\n{out.stderr}"
