"""The SDK's Kubernetes backend and `kubectl jaxps` against an API server that is not there or
never answers: one clear error naming the server and the cause, within the request timeout (and
within `wait`'s own deadline), never a urllib3 traceback or a wait for ever. The servers are
real sockets on 127.0.0.1: one that accepts connections and never answers, and a port where
nothing listens."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from jaxps.sdk import CONDITIONS, Client, ServerUnreachableError, kubectl


def kubeconfig(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


@pytest.fixture
def silent(tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig whose server accepts connections (the kernel's backlog) and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield kubeconfig(tmp_path, server.getsockname()[1])
    finally:
        server.close()


@pytest.fixture
def nobody(tmp_path: Path) -> Path:
    """A kubeconfig whose server's port has nothing listening: connections are refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return kubeconfig(tmp_path, port)


def server_of(config: Path) -> str:
    return str(yaml.safe_load(config.read_text())["clusters"][0]["cluster"]["server"])


def test_a_server_that_never_answers_raises_one_error_naming_it_after_the_timeout(
    silent: Path,
) -> None:
    client = Client.kubernetes(kubeconfig=silent, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(ServerUnreachableError) as caught:
        client.get("mnist")
    assert time.monotonic() - started < 3  # one try of 0.5 s, not four
    assert caught.value.server == server_of(silent)
    assert str(caught.value) == (
        f"cannot reach the Kubernetes API server at {server_of(silent)}: "
        "no answer within 0.5 s (read timeout)"
    )
    assert caught.value.__cause__ is None  # no urllib3 chain under it
    assert isinstance(caught.value, ConnectionError)


def test_a_port_where_nothing_listens_raises_connection_refused(nobody: Path) -> None:
    client = Client.kubernetes(kubeconfig=nobody, timeout=5)
    for call in (lambda: client.get("mnist"), client.list, lambda: client.events("mnist")):
        with pytest.raises(ServerUnreachableError) as caught:
            call()
        assert str(caught.value) == (
            f"cannot reach the Kubernetes API server at {server_of(nobody)}: connection refused"
        )


def test_wait_keeps_its_own_deadline_when_the_server_hangs(silent: Path) -> None:
    client = Client.kubernetes(kubeconfig=silent, timeout=30)
    started = time.monotonic()
    with pytest.raises(ServerUnreachableError, match=r"no answer within 1 s"):
        client.wait("mnist", "Succeeded", timeout=1.0)
    assert time.monotonic() - started < 5  # not the request's 30 s


@pytest.mark.parametrize(
    ("server", "cause"),
    [("silent", "no answer within 0.5 s (read timeout)"), ("nobody", "connection refused")],
)
def test_kubectl_jaxps_prints_one_line_and_exits_1_when_the_server_is_unreachable(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], server: str, cause: str
) -> None:
    config: Path = request.getfixturevalue(server)
    for command in (["get"], ["describe", "mnist"], ["wait", "mnist", "--timeout", "5"]):
        argv = [*command, "--kubeconfig", str(config), "--request-timeout", "0.5"]
        assert kubectl.main(argv) == kubectl.EXIT_FAILED, command
        err = capsys.readouterr().err
        assert err == (
            f"error: cannot reach the Kubernetes API server at {server_of(config)}: {cause}\n"
        ), command


def test_wait_for_an_unknown_condition_is_refused_at_once_on_both_backends(
    nobody: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for client in (Client.kubernetes(kubeconfig=nobody), Client.local(tmp_path / "local")):
        # no request is made: the refused port would say so otherwise
        with pytest.raises(ValueError, match="condition 'Complete'") as caught:
            client.wait("mnist", "Complete")
        assert ", ".join(CONDITIONS) in str(caught.value)
    argv = ["wait", "mnist", "--for", "condition=Complete", "--kubeconfig", str(nobody)]
    assert kubectl.main(argv) == kubectl.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--for 'condition=Complete'" in err
    assert "Created, PodsReady, Running, Restarting, Succeeded, Failed, Suspended" in err
