"""Webhook bodies in the four flavours, retries against a real HTTP server on loopback, the secret never returned."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dflashctl.jobs.notify import Message, body, post, redact

MSG = Message("run-1", "gpu8", "CRASHED", "KeyError on rank0", ["KeyError: 'x'", 'File "a.py", line 3'],
              "fix it", 1, 1.0)  # fmt: skip


def test_bodies():
    data, headers = body(MSG, "slack")
    assert json.loads(data)["text"].startswith("run-1 on gpu8 is CRASHED: KeyError on rank0")
    data, _ = body(MSG, "discord")
    assert "KeyError: 'x'" in json.loads(data)["content"]
    data, headers = body(MSG, "ntfy")
    assert headers["Title"] == "run-1: CRASHED" and headers["Priority"] == "high" and b"next: fix it" in data
    data, _ = body(MSG, "json")
    assert json.loads(data)["state"] == "CRASHED" and json.loads(data)["evidence"][0] == "KeyError: 'x'"


def serve(codes: list[int]):
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            hits.append(self.path)
            self.send_response(codes.pop(0) if codes else 200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, hits


def test_retries_then_succeeds_and_never_returns_the_secret():
    srv, hits = serve([503])
    url = f"http://127.0.0.1:{srv.server_address[1]}/T0/B1/secret-token"
    try:
        line = post(url, MSG, "slack", timeout_s=5, retries=2)
        assert line.startswith("notified http://127.0.0.1/") and "secret-token" not in line
        assert len(hits) == 2
        srv_codes = [404]
        srv2, hits2 = serve(srv_codes)
        url2 = f"http://127.0.0.1:{srv2.server_address[1]}/hook/secret-token"
        line = post(url2, MSG, "json", timeout_s=5, retries=3)
        assert "failed: HTTP 404" in line and "secret-token" not in line and len(hits2) == 1  # 4xx: no retry
        srv2.shutdown()
    finally:
        srv.shutdown()
    assert redact("https://hooks.slack.com/services/T/B/XYZ") == "https://hooks.slack.com/***"
    assert "secret" not in post("http://127.0.0.1:9/x/secret", MSG, timeout_s=1, retries=0)  # refused connection
