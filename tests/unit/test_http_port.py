"""A task's plain-HTTP port (metrics and health) against a client that is not the kubelet, the
operator or Prometheus: other methods and paths, half-sent requests, too many connections, bytes
that are not HTTP. Real sockets on 127.0.0.1; every wait has a deadline."""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from jaxps_operator import schema
from jaxps_runtime.config import cluster
from jaxps_runtime.process import metrics as task_metrics

# Short enough for a unit test; the default (LIMITS) is 5 s.
SECONDS = 1.0
SLACK = 2.0  # what a loaded 2-core machine may add to a deadline
HOST = "127.0.0.1"


class Port:
    """One task's HTTP port, served from this process."""

    def __init__(self, limits: task_metrics.Limits) -> None:
        self.metrics = task_metrics.Metrics(task="ps-0")
        self.limits = limits
        port = self.metrics.serve(0, host=HOST, limits=limits)
        assert port is not None
        self.port = port

    def connect(self) -> socket.socket:
        return socket.create_connection((HOST, self.port), timeout=SECONDS + SLACK)

    def ask(self, request: bytes, *, wait: float = SECONDS + SLACK) -> bytes:
        """What the port answers to `request` before it closes; fails if it holds the
        connection open past `wait` seconds."""
        with socket.create_connection((HOST, self.port), timeout=wait) as sock:
            try:
                sock.sendall(request)
            except OSError:  # closed while we still sent: an answer of nothing
                return b""
            return read_to_close(sock, wait=wait)

    def status(self, method: str, path: str) -> int:
        return status_of(self.ask(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()))


def read_to_close(sock: socket.socket, *, wait: float) -> bytes:
    deadline = time.monotonic() + wait
    got = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"held open {wait:.1f} s; got {got[:80]!r}")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        except TimeoutError:
            raise AssertionError(f"held open {wait:.1f} s; got {got[:80]!r}") from None
        if not chunk:
            return got
        got += chunk


def status_of(answer: bytes) -> int:
    """The status code of an HTTP/1.x answer; 0 for none."""
    if not answer.startswith(b"HTTP/1."):
        return 0
    return int(answer.split(b" ", 2)[1])


def wait_for(condition: Any, *, what: str, seconds: float = SECONDS + SLACK) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def port() -> Iterator[Port]:
    """One port for the module's tests (closing one takes half a second): no test leaves a
    connection behind."""
    served = Port(task_metrics.Limits(request_seconds=SECONDS, per_client=64))
    yield served
    served.metrics.close()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"])
@pytest.mark.parametrize("path", task_metrics.PATHS)
def test_a_method_other_than_get_or_head_gets_405(port: Port, method: str, path: str) -> None:
    answer = port.ask(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
    assert status_of(answer) == 405
    assert b"\r\nAllow: GET, HEAD\r\n" in answer


def test_a_post_with_a_body_gets_405_without_the_body_being_waited_for(port: Port) -> None:
    request = b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nabc"
    started = time.monotonic()
    assert status_of(port.ask(request)) == 405
    assert time.monotonic() - started < SECONDS


@pytest.mark.parametrize(
    "path", ["/", "/favicon.ico", "/metrics/", "/healthz/x", "/READYZ", "/x" * 100]
)
def test_a_path_other_than_metrics_healthz_readyz_gets_404(port: Port, path: str) -> None:
    assert port.status("GET", path) == 404


def test_head_answers_as_get_does_without_a_body(port: Port) -> None:
    for path in task_metrics.PATHS:
        head = port.ask(f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        get = port.ask(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status_of(head) == status_of(get) != 0
        head_headers, head_body = head.split(b"\r\n\r\n", 1)
        get_body = get.split(b"\r\n\r\n", 1)[1]
        assert head_body == b""
        assert f"Content-Length: {len(get_body)}".encode() in head_headers


def test_a_query_on_the_metrics_path_is_still_the_metrics(port: Port) -> None:
    port.metrics.global_step.set(3)
    answer = port.ask(b"GET /metrics?name[]=jaxps_global_step HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(answer) == 200
    assert b'jaxps_global_step{task="ps-0"} 3.0' in answer


def test_sixty_half_sent_requests_are_dropped_within_the_timeout_while_healthz_answers(
    port: Port,
) -> None:
    held = [port.connect() for _ in range(60)]
    try:
        sent = time.monotonic()
        for i, sock in enumerate(held):
            half = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GET /metr"
            sock.sendall(half)
        assert port.status("GET", "/healthz") == 200
        for sock in held:
            read_to_close(sock, wait=SECONDS + SLACK - (time.monotonic() - sent))
        assert time.monotonic() - sent < SECONDS + SLACK
    finally:
        for sock in held:
            sock.close()
    assert port.status("GET", "/healthz") == 200


def send_slowly(sock: socket.socket, data: bytes, *, every: float, wait: float) -> float:
    """Sends `data` a byte every `every` seconds; the seconds until the port dropped it."""
    started = time.monotonic()
    for byte in data:
        try:
            sock.send(bytes([byte]))
        except OSError:  # reset, or a broken pipe: dropped
            return time.monotonic() - started
        time.sleep(every)
        if time.monotonic() - started > wait:
            raise AssertionError(f"still held after {wait} s")
    raise AssertionError("the whole slow request was taken")


def test_a_request_sent_a_byte_at_a_time_is_dropped_at_its_deadline_not_served(
    port: Port,
) -> None:
    """A read timeout alone would let a client that sends a byte now and then hold forever."""
    with port.connect() as sock:
        slow = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 1000
        assert send_slowly(sock, slow, every=SECONDS / 10, wait=SECONDS + SLACK) >= SECONDS


def test_connections_over_the_cap_are_closed_at_once_and_served_again_once_freed() -> None:
    served = Port(task_metrics.Limits(request_seconds=30.0, connections=8, per_client=8))
    held = [served.connect() for _ in range(8)]
    try:
        for sock in held:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # each holds its slot for 30 s
        started = time.monotonic()
        answer = served.ask(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", wait=SECONDS)
        assert answer == b"" or status_of(answer) == 503
        assert time.monotonic() - started < SECONDS
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: served.status("GET", "/healthz") == 200, what="healthz once the 8 have gone")
    served.metrics.close()


def test_one_client_address_over_its_share_is_closed_at_once_while_others_are_served() -> None:
    """A peer (a worker's pod) that fills its share cannot fail the kubelet's probes, which
    come from the node's address."""
    served = Port(task_metrics.Limits(request_seconds=30.0, per_client=4))
    held = [served.connect() for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        started = time.monotonic()
        answer = served.ask(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", wait=SECONDS)
        assert answer == b"" or status_of(answer) == 503
        assert time.monotonic() - started < SECONDS
        with socket.create_connection(
            (HOST, served.port), timeout=SECONDS + SLACK, source_address=("127.0.0.2", 0)
        ) as other:
            other.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(read_to_close(other, wait=SECONDS + SLACK)) == 200
    finally:
        for sock in held:
            sock.close()
        served.metrics.close()


def fuzz_requests(seed: int, count: int) -> list[bytes]:
    """Random bytes, malformed request lines and headers, huge and many headers, and valid
    requests with a byte changed, inserted or cut: reproducible from `seed`."""
    rng = random.Random(seed)
    valid = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n"
    fixed = [
        b"",
        b"\r\n\r\n",
        b"GET\r\n\r\n",
        b"GET /metrics\r\n\r\n",
        b"GET  HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/1.1 extra\r\n\r\n",
        b"GET /metrics HTTP/9.9\r\n\r\n",
        b"GET /metrics HTTP/1.x\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),  # a TLS hello
        b"G\xffT /metrics HTTP/1.1\r\n\r\n",
        b"\x00GET /metrics HTTP/1.1\r\n\r\n",
        b"GET /%zz%00%ff HTTP/1.1\r\n\r\n",
        b"GET /metrics?%%%&&&=== HTTP/1.1\r\n\r\n",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"A" * 100000,
        b"GET /metrics HTTP/1.1\r\nX: " + b"b" * 20000 + b"\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"X: " + b"c" * 1000 + b"\r\n" * 2000,
        b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n folded\r\n continued\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
        b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffff\r\n",
        b"GET /metrics HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nAccept-Encoding: gzip\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=9\r\n\r\n",
        b"GET /metrics HTTP/1.1\n\n",
        b"GET /metrics HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n" * 50,
        b"GET http://evil.example/metrics HTTP/1.1\r\n\r\n",
        b"CONNECT 127.0.0.1:2222 HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x",  # half a request
    ]
    cases = list(fixed)
    while len(cases) < count:
        kind = rng.randrange(4)
        if kind == 0:
            cases.append(rng.randbytes(rng.randrange(1, 3000)))
        elif kind == 1:
            junk = bytes(rng.choice(b" /:?%\t\x00\xffAZaz09-.") for _ in range(rng.randrange(80)))
            cases.append(junk + b"\r\n" + junk + b"\r\n\r\n")
        else:
            request = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                at = rng.randrange(len(request))
                edit = rng.randrange(3)
                if edit == 0:
                    request[at] = rng.randrange(256)
                elif edit == 1:
                    request[at:at] = rng.randbytes(rng.randrange(1, 20))
                else:
                    del request[at : at + rng.randrange(1, 10)]
            cases.append(bytes(request))
    return cases


def test_fuzzed_requests_get_4xx_or_a_close_never_a_hang_or_a_500_and_metrics_go_on(
    port: Port,
) -> None:
    """The port's contract for bytes that are not a GET of its paths: a 4xx (505 for an HTTP
    version it does not speak) or a closed connection, within the request deadline. Valid
    requests that survived a mutation may still get their 200."""
    port.metrics.global_step.set(11)
    threads_before = threading.active_count()

    def verdict(request: bytes) -> tuple[bytes, int]:
        return request, status_of(port.ask(request))

    with ThreadPoolExecutor(max_workers=16) as pool:
        verdicts = list(pool.map(verdict, fuzz_requests(seed=32, count=400)))
    bad = [(r[:60], code) for r, code in verdicts if code not in (0, 200, 505, *range(400, 500))]
    assert bad == []
    assert sum(code == 0 for _, code in verdicts) > 0  # some were closed without an answer
    assert sum(400 <= code < 500 for _, code in verdicts) > 0
    answer = port.ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(answer) == 200
    assert b'jaxps_global_step{task="ps-0"} 11.0' in answer
    wait_for(
        lambda: threading.active_count() <= threads_before,
        what=f"the port's threads back to {threads_before}",
    )


def other_loopback_refused(port: int) -> bool:
    """Whether 127.0.0.2, another address of this host, refuses `port`."""
    try:
        socket.create_connection(("127.0.0.2", port), timeout=SECONDS).close()
    except ConnectionRefusedError:
        return True
    return False


def test_the_port_listens_on_the_address_given_and_no_other() -> None:
    m = task_metrics.Metrics(task="ps-0")
    port = m.serve(0, host=HOST)
    assert port is not None
    try:
        assert other_loopback_refused(port)
    finally:
        m.close()


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_pod_address_is_listened_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(task_metrics.ADDRESS_ENV, raising=False)
    monkeypatch.setenv(task_metrics.POD_IP_ENV, "::1")
    m = task_metrics.Metrics(task="ps-0")
    port = m.serve(0)
    assert port is not None
    try:
        with socket.create_connection(("::1", port), timeout=SECONDS + SLACK) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(read_to_close(sock, wait=SECONDS + SLACK)) == 200
    finally:
        m.close()


@pytest.mark.parametrize(
    ("environ", "host"),
    [
        ({"JAXPS_METRICS_ADDRESS": "0.0.0.0", "JAXPS_POD_IP": "10.1.2.3"}, "0.0.0.0"),
        ({"JAXPS_POD_IP": "10.1.2.3", "TF_CONFIG": "x"}, "10.1.2.3"),
        (
            {
                "TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5001"]}, '
                '"task": {"type": "worker", "index": 1}}'
            },
            "127.0.0.1",
        ),
        (
            {
                "TF_CONFIG": '{"cluster": {"worker": ["localhost:5000"]}, '
                '"task": {"type": "worker", "index": 0}}'
            },
            "127.0.0.1",
        ),
        (
            {
                "TF_CONFIG": '{"cluster": {"worker": ["j-worker-0.j.ns.svc:2222"]}, '
                '"task": {"type": "worker", "index": 0}}'
            },
            "",
        ),
        ({"TF_CONFIG": "not json"}, ""),
        ({}, ""),
    ],
    ids=[
        "setting",
        "pod-ip",
        "loopback-task",
        "localhost-task",
        "dns-task",
        "bad-tf-config",
        "none",
    ],
)
def test_the_listen_address_is_the_setting_else_the_pod_ip_else_a_loopback_task_address(
    environ: dict[str, str], host: str
) -> None:
    assert task_metrics.listen_host(environ)[0] == host


def test_a_loopback_task_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (task_metrics.ADDRESS_ENV, task_metrics.POD_IP_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["127.0.0.1:5000"]}, "task": {"type": "worker", "index": 0}}',
    )
    m = task_metrics.Metrics(task="worker-0")
    port = m.serve(0)
    assert port is not None
    try:
        assert other_loopback_refused(port)
    finally:
        m.close()


def test_with_no_address_known_it_listens_everywhere_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in (task_metrics.ADDRESS_ENV, task_metrics.POD_IP_ENV, "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    m = task_metrics.Metrics(task="worker-0")
    with caplog.at_level(logging.WARNING, logger=task_metrics.__name__):
        port = m.serve(0)
    assert port is not None
    try:
        assert not other_loopback_refused(port)
        assert "listening on all interfaces" in caplog.text
    finally:
        m.close()


def test_a_bad_address_setting_turns_the_port_off_naming_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(task_metrics.ADDRESS_ENV, "pod.example:9090")
    m = task_metrics.Metrics(task="worker-0")
    assert m.serve(0) is None
    assert 'JAXPS_METRICS_ADDRESS: got "pod.example:9090"' in caplog.text


def test_an_empty_address_setting_is_refused_too(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(task_metrics.ADDRESS_ENV, "")
    assert task_metrics.Metrics(task="worker-0").serve(0) is None
    assert 'JAXPS_METRICS_ADDRESS: got ""' in caplog.text


@pytest.mark.parametrize("value", ["10.1.2.3", "0.0.0.0", "::", "fd00::3", "127.0.0.1"])
def test_an_ip_address_is_a_good_address_setting(value: str) -> None:
    assert cluster.setting_problem("JAXPS_METRICS_ADDRESS", value, task_type="ps") is None


@pytest.mark.parametrize("value", ["", "localhost", "[::1]", "10.1.2.3:9090", "10.1.2", "any"])
def test_anything_but_an_ip_address_fails_the_job_before_any_pod(value: str) -> None:
    job = {
        "spec": {
            "replicaSpecs": {
                "worker": {
                    "template": {
                        "spec": {
                            "containers": [
                                {"env": [{"name": "JAXPS_METRICS_ADDRESS", "value": value}]}
                            ]
                        }
                    }
                }
            }
        }
    }
    [problem] = schema.setting_problems(job)
    assert problem.path == "spec.replicaSpecs.worker.template.spec.containers[0].env[0].value"
    assert problem.message.startswith(f"JAXPS_METRICS_ADDRESS: got {value!r}".replace("'", '"'))
    assert "0.0.0.0 or :: for all interfaces" in problem.message
