"""A real webhook listener on loopback for the tests: it keeps every request (method, path, headers, body) and can
answer at once, late, by a redirect, with an error, by dripping its answer a byte at a time, or never."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOOK_SECRET = "T0B1xSeCrEtHookPath"


class Listener:
    """`mode`: "ok" (200 at once), "slow" (200 after `delay_s`), "redirect" (302 to `/elsewhere`), "status"
    (`code`), "drip" (a header byte every `delay_s`), "silent" (reads the request, never answers)."""

    def __init__(self, port: int = 0, mode: str = "ok", delay_s: float = 0.0, code: int = 500) -> None:
        self.hits: list[dict] = []
        self.mode, self.delay_s, self.code = mode, delay_s, code
        self.closing = threading.Event()
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def _take(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                try:
                    body = json.loads(data) if data else None
                except ValueError:
                    body = data.decode(errors="replace")
                listener.hits.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": dict(self.headers),
                        "body": body,
                        "time": time.monotonic(),
                    }
                )

            def do_GET(self) -> None:  # noqa: N802 - a redirect followed as a GET would land here
                self._take()
                self.send_response(200)
                self.end_headers()

            def do_POST(self) -> None:  # noqa: N802
                self._take()
                mode = listener.mode
                if mode == "silent":
                    listener.closing.wait(60)
                    return
                if mode == "slow":
                    listener.closing.wait(listener.delay_s)
                if mode == "drip":
                    for b in b"HTTP/1.1 200 OK\r\n\r\n":
                        if listener.closing.wait(listener.delay_s):
                            return
                        try:
                            self.wfile.write(bytes([b]))
                            self.wfile.flush()
                        except OSError:
                            return
                    return
                if mode == "redirect":
                    self.send_response(302)
                    self.send_header("Location", f"http://127.0.0.1:{listener.port}/elsewhere/{HOOK_SECRET}")
                    self.end_headers()
                    return
                self.send_response(listener.code if mode == "status" else 200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def url(self, secret: str = HOOK_SECRET) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/{secret}"

    def posts(self) -> list[dict]:
        return [h for h in self.hits if h["method"] == "POST"]

    def bodies(self) -> list:
        return [h["body"] for h in self.posts()]

    def states(self) -> list[str]:
        return [b["state"] for b in self.bodies() if isinstance(b, dict)]

    def keys(self) -> list[str]:
        return [h["headers"].get("Idempotency-Key") for h in self.posts()]

    def close(self) -> None:
        self.closing.set()
        self.srv.shutdown()
        self.srv.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
