"""The bench tests' stand-in for SGLang's /generate: a local HTTP server that records each request
body and answers with what the test gives (`generate_stub`)."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@contextlib.contextmanager
def _stub(answer: bytes = b"{}", stream=None, top_logprobs: int = 0):
    """(server-like object with url, alive() and top_logprobs; the request bodies received). Each
    POST answers `answer` as JSON or, with stream(write), whatever stream writes as an event stream."""
    bodies: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
            self.end_headers()
            if stream:
                stream(self.wfile.write)
            else:
                self.wfile.write(answer)

        def log_message(self, *a):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    srv = type("S", (), {"url": f"http://127.0.0.1:{httpd.server_port}", "top_logprobs": top_logprobs,
                         "alive": lambda self: True})()
    try:
        yield srv, bodies
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def generate_stub():
    pytest.importorskip("requests")
    return _stub


@pytest.fixture(autouse=True)
def own_groups_file(tmp_path, monkeypatch):
    """Each test's own list of started process groups (server.GROUPS_FILE), not the machine's:
    another harness or test run may be using that one."""
    from tutti_hicache.benchmarks import server
    monkeypatch.setattr(server, "GROUPS_FILE", str(tmp_path / "groups"))
