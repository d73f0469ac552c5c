"""The API client's one retry on a kept connection the server closed: on a new connection."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from jaxps_operator import apiserver


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client keeps the connection

    def do_GET(self) -> None:
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def server() -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_a_retry_after_a_stale_kept_connection_takes_a_new_one(
    server: http.server.ThreadingHTTPServer,
) -> None:
    """Two kept connections, both closed by the server (an API server restarted, or its idle
    timeout): the retry took the second stale one, and the pass failed with
    RemoteDisconnected."""
    api = apiserver.Api(apiserver.Server("http", "127.0.0.1", server.server_address[1], None))
    barrier = threading.Barrier(2)

    def call() -> None:
        barrier.wait()
        api.call("GET", "/x")

    callers = [threading.Thread(target=call) for _ in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    kept = list(api._idle.queue)
    for conn in kept:  # the server side goes away; the client does not know yet
        assert conn.sock is not None
        conn.sock.shutdown(2)
    assert len(kept) >= 1
    assert api.call("GET", "/x") == {}
