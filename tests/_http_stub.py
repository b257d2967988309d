"""A stand-in HTTP server for commands that talk to one (Prometheus, /debug/kv, /v1/models): it answers every GET
with one status and body, quietly, and records the paths asked for."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def answering(status: int = 200, body: bytes = b"", asked: list[str] | None = None) -> Iterator[str]:
    """Yields the stub's base URL; `asked` collects each GET's path."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if asked is not None:
                asked.append(self.path)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
