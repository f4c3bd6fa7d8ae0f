"""``sluice.net.poll_json``: waits for a server whose JSON is not there yet (a Spark driver's UI
comes up after its server listens, its REST API lists the application later still), and gives up
with the last error. Cost: ~1 s (a loopback HTTP server on a thread)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sluice.net import free_port, poll_json


def _serve(port: int, answers: list[object]) -> ThreadingHTTPServer:
    """Answers each GET with the next of ``answers`` as JSON (the last one from then on)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(answers.pop(0) if len(answers) > 1 else answers[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_waits_for_the_server_and_for_what_it_lists():
    port = free_port()
    started: list[ThreadingHTTPServer] = []
    # nothing listens for 0.3 s, then the application list is empty twice, then it holds one
    timer = threading.Timer(0.3, lambda: started.append(_serve(port, [[], [], [{"id": "app-1"}]])))
    timer.start()
    try:
        t0 = time.monotonic()
        app = poll_json(f"http://127.0.0.1:{port}/api/v1/applications", lambda apps: str(apps[0]["id"]),
                        timeout_s=10, every_s=0.05)
        assert app == "app-1"
        assert time.monotonic() - t0 >= 0.3
    finally:
        timer.join()
        for server in started:
            server.shutdown()


def test_gives_up_with_the_last_error():
    port = free_port()
    server = _serve(port, [{"histograms": {}}])
    try:
        t0 = time.monotonic()
        with pytest.raises(StopIteration):  # the metric never appears
            poll_json(f"http://127.0.0.1:{port}/metrics/json",
                      lambda m: next(v for k, v in m["histograms"].items() if k.endswith("compilationTime")),
                      timeout_s=0.3, every_s=0.05)
        assert 0.3 <= time.monotonic() - t0 < 5
    finally:
        server.shutdown()
