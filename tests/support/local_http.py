"""A real HTTP server on 127.0.0.1 for the tests' fake SGLang servers: the plumbing they share."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType
from typing import Any

import pytest


class JSONHandler(BaseHTTPRequestHandler):
    """Request handler with quiet logging and JSON/bytes answers; subclasses add ``do_GET``/``do_POST``."""

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def send_bytes(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout tests)

    def send_json(self, obj: Any, status: int = 200) -> None:
        self.send_bytes(status, json.dumps(obj).encode())

    def read_json(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))


@contextlib.contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a free port of 127.0.0.1 in a thread; yields the base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def quick_retries(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> None:
    """The client class ``module.<name>`` that a tool builds, backing off 10 ms doubling up to 50 ms instead of
    1 s doubling: the same retries, without seconds spent asleep."""
    cls = getattr(module, name)

    class QuickRetries(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **{**kw, "backoff": 0.01, "max_backoff": 0.05})

    monkeypatch.setattr(module, name, QuickRetries)
