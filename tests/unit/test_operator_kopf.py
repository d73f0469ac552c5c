"""The operator's use of kopf and the official client, in the parts that need no API server:
which namespaces `--namespace` patterns name (kopf's matching), kopf's settings (server-side
selectors, nothing posted or stored by kopf), the Lease's lock once stopped, and the client's
raw calls against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kopf
import pytest
from kopf._cogs.structs import references
from kubernetes import client

from jaxps_operator import controller, kubeclient


def watched(patterns: tuple[str, ...], namespace: str) -> bool:
    return any(
        references.match_namespace(references.NamespaceName(namespace), p)
        for p in controller.kopf_namespaces(patterns)
    )


@pytest.mark.parametrize(
    ("patterns", "accepted", "refused"),
    [
        (("a", "b"), ["a", "b"], ["c", "ab"]),
        (("team-*",), ["team-a", "team-b"], ["teams", "default"]),
        (("team-*", "!team-secret"), ["team-a"], ["team-secret", "default"]),
        (("!kube-*",), ["default", "team-a"], ["kube-system"]),
        (("team-?", "ops"), ["team-a", "ops"], ["team-ab", "default"]),
        (("a-*", "b-*", "!*-x"), ["a-1", "b-1"], ["a-x", "b-x", "c-1"]),
    ],
    ids=["names", "glob", "glob-less-one", "all-but", "glob-and-name", "globs-less-one"],
)
def test_namespace_patterns_name_the_namespaces_kopf_watches(
    patterns: tuple[str, ...], accepted: list[str], refused: list[str]
) -> None:
    assert all(watched(patterns, ns) for ns in accepted)
    assert not any(watched(patterns, ns) for ns in refused)


def test_named_namespaces_stay_names_kopf_can_watch_without_listing_namespaces() -> None:
    assert controller.kopf_namespaces(("a", "b")) == ("a", "b")
    assert references.select_specific_namespaces(controller.kopf_namespaces(("a", "b"))) == {
        "a",
        "b",
    }


def test_kopf_selects_the_jobs_children_on_the_server_and_posts_and_stores_nothing() -> None:
    found = controller.settings(controller.Options())
    selectors = {
        (s.group, s.any_name): v
        for s, v in found.watching.label_selectors.items()
        if isinstance(s, references.Selector)
    }
    assert selectors == {
        ("", "pods"): "jaxps.dev/job-name",
        ("", "services"): "jaxps.dev/job-name",
        ("kueue.x-k8s.io", "workloads"): "jaxps.dev/job-name",
    }
    assert found.posting.enabled is False
    body = kopf.Body({"metadata": {"name": "x", "annotations": {}}, "spec": {"a": 1}})
    assert found.persistence.diffbase_storage.build(body=body) == {}
    assert found.persistence.diffbase_storage.fetch(body=body) is None


def test_the_leases_lock_writes_nothing_once_stopped() -> None:
    stopped = threading.Event()
    lock = controller._Lock("jaxps", "ns", "me", stopped)
    stopped.set()
    assert lock.create("jaxps", "ns", object()) is False
    assert lock.update("jaxps", "ns", object()) is False


class Server:
    """A real HTTP server on 127.0.0.1 that answers each request from `answers` and keeps
    what it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], Any]] = []
        self.answers: list[tuple[int, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                outer.seen.append((self.command, self.path, dict(self.headers), body))
                code, reply = outer.answers.pop(0)
                data = json.dumps(reply).encode() if reply is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _answer  # noqa: N815

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}"


@pytest.fixture
def server() -> Iterator[Server]:
    found = Server()
    try:
        yield found
    finally:
        found.http.shutdown()


def api(server: Server) -> kubeclient.Api:
    configuration = client.Configuration(host=server.url)
    configuration.api_key = {"BearerToken": "secret-token"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    return kubeclient.Api(configuration)


def test_a_call_sends_the_dict_the_token_and_the_query_and_answers_the_json(
    server: Server,
) -> None:
    server.answers.append((201, {"metadata": {"name": "p", "uid": "u"}}))
    made = api(server).call(
        "POST",
        "/api/v1/namespaces/ns/pods",
        query={"fieldManager": "jaxps", "dryRun": None},
        body={"metadata": {"name": "p"}},
    )
    assert made == {"metadata": {"name": "p", "uid": "u"}}
    ((method, path, headers, body),) = server.seen
    assert (method, path, body) == (
        "POST",
        "/api/v1/namespaces/ns/pods?fieldManager=jaxps",
        {"metadata": {"name": "p"}},
    )
    lower = {k.lower(): v for k, v in headers.items()}
    assert lower["authorization"] == "Bearer secret-token"
    assert lower["content-type"] == "application/json"


@pytest.mark.parametrize("status", [404, 409, 422, 500])
def test_a_refusal_raises_the_clients_exception_with_the_servers_words(
    server: Server, status: int
) -> None:
    server.answers.append((status, {"kind": "Status", "message": f'pods "p" said {status}'}))
    with pytest.raises(kubeclient.ApiError) as err:
        api(server).call("GET", "/api/v1/namespaces/ns/pods/p")
    assert err.value.status == status
    assert kubeclient.message_of(err.value) == f'pods "p" said {status}'


def test_an_empty_answer_is_none(server: Server) -> None:
    server.answers.append((200, None))
    assert api(server).call("DELETE", "/api/v1/namespaces/ns/pods/p") is None
