"""The informer's list-then-watch against a scripted HTTP server on 127.0.0.1: events are handed
on in order, and after a watch too old to resume (410) the new list hands on, as DELETED, what
went away meanwhile (a bare re-list would lose it)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from jaxps_operator import apiserver, informer


def obj(name: str, version: int) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ns",
            "name": name,
            "resourceVersion": str(version),
            "labels": {"jaxps.dev/job-name": "tj"},
        }
    }


class Script:
    """What the server answers: lists in turn, and per watch its events (then it ends it)."""

    def __init__(self) -> None:
        self.lists = [
            {"metadata": {"resourceVersion": "10"}, "items": [obj("a", 5), obj("b", 6)]},
            {"metadata": {"resourceVersion": "20"}, "items": [obj("b", 6), obj("c", 18)]},
        ]
        self.watches: list[list[dict[str, Any]]] = [
            [
                {"type": "MODIFIED", "object": obj("b", 11)},
                {"type": "ERROR", "object": {"code": 410, "reason": "Expired"}},
            ],
        ]
        self.requests: list[str] = []


@pytest.fixture
def server() -> Iterator[tuple[Script, apiserver.Api]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            script.requests.append(self.path)
            if "watch=true" in self.path:
                events = script.watches.pop(0) if script.watches else []
                body = b"".join(json.dumps(e).encode() + b"\n" for e in events)
                if not events:
                    time.sleep(0.5)  # a quiet watch, then the server ends it
            else:
                body = json.dumps(script.lists.pop(0) if script.lists else {}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    api = apiserver.Api(apiserver.Server("http", "127.0.0.1", http.server_address[1], None))
    try:
        yield script, api
    finally:
        http.shutdown()


def test_a_watch_too_old_to_resume_lists_again_and_hands_on_what_went_away(
    server: tuple[Script, apiserver.Api],
) -> None:
    script, api = server
    seen: list[tuple[str, str, str]] = []
    watch = informer.Informer(
        api,
        "/api/v1/namespaces/ns/pods",
        lambda type_, o: seen.append(
            (
                type_,
                o["metadata"]["name"],
                o["metadata"].get("labels", {}).get("jaxps.dev/job-name"),
            )
        ),
        selector="jaxps.dev/job-name",
    )
    watch.start()
    try:
        deadline = time.monotonic() + 10
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watch.stop()
    assert watch.synced.is_set()
    assert sorted(seen[:2]) == [("ADDED", "a", "tj"), ("ADDED", "b", "tj")]
    assert seen[2] == ("MODIFIED", "b", "tj")
    # the second list: b as it was listed (a version not seen), c new, a gone with its labels
    assert sorted(seen[3:]) == [
        ("ADDED", "c", "tj"),
        ("DELETED", "a", "tj"),
        ("MODIFIED", "b", "tj"),
    ]
    first_watch = next(r for r in script.requests if "watch=true" in r)
    assert "resourceVersion=10" in first_watch
    assert "allowWatchBookmarks=true" in first_watch
