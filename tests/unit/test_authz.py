"""Who may call what: the authorization table by method and role; identities in certificates."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from jaxps_runtime.wire import authz, credentials, rpc
from jaxps_runtime.wire.credentials import Identity

CHIEF_ONLY = ("Init", "Assign", "Restore", "Save", "SetWorkers", "Shutdown")
TRAINERS = ("Update",)
READERS = ("Status", "Read")
PS = "/jaxps.v1.ParameterServer/"
COORDINATOR = "/jaxps.v1.Coordinator/"


def who(role: str, index: int = 0, job: str = "j") -> Identity:
    return Identity(job=job, role=role, index=index)


@pytest.mark.parametrize(
    ("caller", "chief", "allowed"),
    [
        (who("chief"), ("chief", 0), set(CHIEF_ONLY + TRAINERS + READERS)),
        (who("worker", 0), ("worker", 0), set(CHIEF_ONLY + TRAINERS + READERS)),
        (who("worker", 0), ("chief", 0), set(TRAINERS + READERS)),
        (who("worker", 3), ("chief", 0), set(TRAINERS + READERS)),
        (who("evaluator"), ("chief", 0), set(READERS)),
        (who("ps", 1), ("chief", 0), set()),
        (who("chief", job="another"), ("chief", 0), set()),
    ],
    ids=[
        "chief",
        "worker-0-as-chief",
        "worker-0-with-a-chief",
        "worker-3",
        "evaluator",
        "ps",
        "another-job",
    ],
)
def test_every_parameter_server_method_by_role(
    caller: Identity, chief: tuple[str, int], allowed: set[str]
) -> None:
    for name, spec in rpc.PARAMETER_SERVER.methods.items():
        method = name.removesuffix(rpc.PACKED)  # a packed twin is its method to authorization
        assert authz.allowed(spec.authz_path, caller, job="j", chief=chief) == (
            method in allowed
        ), name


def test_the_table_covers_every_method_of_both_services() -> None:
    paths = {s.authz_path for s in rpc.PARAMETER_SERVER.methods.values()}
    paths |= {s.authz_path for s in rpc.COORDINATOR.methods.values()}
    assert paths == set(authz.TABLE)


def test_the_chief_workers_and_the_evaluator_register_and_heartbeat_a_ps_does_not() -> None:
    for method in ("Register", "Heartbeat"):
        path = COORDINATOR + method
        assert authz.allowed(path, who("worker", 1), job="j", chief=("worker", 0))
        assert authz.allowed(path, who("evaluator"), job="j", chief=("worker", 0))
        assert authz.allowed(path, who("worker", 0), job="j", chief=("worker", 0))
        assert not authz.allowed(path, who("ps"), job="j", chief=("worker", 0))
        assert not authz.allowed(path, None, job="j", chief=("worker", 0))


def test_an_unknown_method_is_allowed_to_nobody() -> None:
    assert not authz.allowed(PS + "Nope", who("chief"), job="j", chief=("chief", 0))


def test_a_certificate_names_its_task_and_hosts_and_hides_its_key() -> None:
    ca = credentials.authority("uid-1")
    issued = credentials.issue(
        ca, who("worker", 2, job="uid-1"), hosts=["tj-worker-2.tj.ns.svc", "127.0.0.1"]
    )
    assert issued.identity() == who("worker", 2, job="uid-1")
    assert "PRIVATE" not in repr(issued)
    assert "PRIVATE" not in repr(ca)
    assert credentials.identity_of(b"not a certificate") is None


@pytest.mark.parametrize(
    "uri",
    [
        "jaxps://j/ps",
        "jaxps://j/master/0",
        "jaxps://j/ps/x",
        "spiffe://j/ps/0",
        "jaxps:///ps/0",
        "jaxps://j/ps/²",  # a digit to str.isdigit, not to int()
    ],
)
def test_uris_that_name_no_task_are_refused(uri: str) -> None:
    assert Identity.parse(uri) is None


def test_a_credentials_directory_round_trips_and_names_what_is_wrong(tmp_path: object) -> None:

    directory = Path(str(tmp_path)) / "creds"
    ca = credentials.authority("uid-1")
    issued = credentials.issue(ca, who("ps", 0, job="uid-1"), hosts=["127.0.0.1"])
    issued.write(directory)
    assert (directory / credentials.KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert credentials.TaskCredentials.load(directory) == issued
    other = credentials.issue(ca, who("ps", 1, job="uid-1"), hosts=["127.0.0.1"])
    (directory / credentials.KEY_FILE).write_bytes(other.key)
    with pytest.raises(credentials.CredentialsError, match=r"is not the key of tls\.crt"):
        credentials.TaskCredentials.load(directory)
    (directory / credentials.CA_FILE).unlink()
    with pytest.raises(credentials.CredentialsError, match=r"ca\.crt: cannot read it"):
        credentials.TaskCredentials.load(directory)


def test_a_peer_is_the_first_jaxps_uri_among_its_verified_names() -> None:
    names = [b"tj-ps-0.tj.ns.svc", b"spiffe://j/ps/0", b"jaxps://j/worker/1", b"jaxps://j/chief/0"]
    assert authz.peer_identity(names) == who("worker", 1)
    assert authz.peer_identity([b"127.0.0.1", b"jaxps://j/ps"]) is None
    assert authz.peer_identity([b"\xff\xfe"]) is None
    assert authz.peer_identity(None) is None  # plaintext: no names at all


def gate(chief: tuple[str, int] = ("worker", 0)) -> authz.Gate:
    return authz.Gate(job="j", chief=chief)


@pytest.mark.parametrize(
    ("caller", "claimed"),
    [
        (who("worker", 1), "worker-1"),
        (who("worker", 0), "worker-0"),  # the chief of a job without a chief task
        (who("chief", 0), "chief-0"),
        (who("evaluator", 0), "evaluator-0"),
    ],
    ids=["worker-1", "worker-0-as-chief", "chief", "evaluator"],
)
def test_a_request_speaking_for_the_callers_own_task_passes_the_gate(
    caller: Identity, claimed: str
) -> None:
    chief = ("chief", 0) if caller.role == "chief" else ("worker", 0)
    assert gate(chief).refusal(PS + "Read", caller, lambda: claimed) is None
    assert gate(chief).refusal(COORDINATOR + "Heartbeat", caller, lambda: claimed) is None


@pytest.mark.parametrize(
    ("method", "claimed"),
    [
        (PS + "Update", "worker-1"),
        (PS + "Update", ""),
        (PS + "Read", "worker-0 "),
        (COORDINATOR + "Heartbeat", "worker-1"),
        (COORDINATOR + "Register", "evaluator-0"),
    ],
    ids=["push-as-another", "push-as-nobody", "read-as-a-lookalike", "heartbeat", "register"],
)
def test_a_request_speaking_for_another_task_is_permission_denied_naming_both(
    method: str, claimed: str
) -> None:
    refused = gate().refusal(method, who("worker", 0), lambda: claimed)
    assert refused is not None
    assert refused.code == "PERMISSION_DENIED"
    assert repr(claimed) in refused.details
    assert "'worker-0'" in refused.details


def test_a_request_is_not_read_before_the_callers_role_is_allowed() -> None:
    def never() -> str:
        raise AssertionError("the request was read")

    assert gate().refusal(PS + "Shutdown", who("worker", 1), never) == authz.NOT_ALLOWED
    assert gate().refusal(PS + "Read", who("ps", 0), never) == authz.NOT_ALLOWED
    assert gate().refusal(PS + "Read", None, never) == authz.UNAUTHENTICATED
    other = who("worker", 0, job="another")
    assert gate().refusal(PS + "Read", other, never) == authz.NOT_ALLOWED


def test_a_server_certificate_names_neither_job_nor_task_and_a_client_one_only_its_task() -> None:
    ca = credentials.authority("uid-1")
    issued = credentials.issue(ca, who("ps", 3, job="uid-1"), hosts=["tj-ps-3.tj.ns.svc"])
    server = x509.load_pem_x509_certificate(issued.server_cert)
    client = x509.load_pem_x509_certificate(issued.client_cert)
    shown = f"{server.subject} {server.issuer} {server.extensions}"
    for secret in ("uid-1", "ps-3", "/ps/", "tj-ps-3", "jaxps://"):
        assert secret not in shown, secret
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [issued.server_name("tj-ps-3.tj.ns.svc")]
    uris = client.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert uris.get_values_for_type(x509.UniformResourceIdentifier) == ["jaxps://uid-1/ps/3"]
    assert issued.identity() == who("ps", 3, job="uid-1")


def test_a_server_name_depends_on_the_host_and_the_job_and_old_credentials_check_the_host() -> None:
    ca, other = credentials.authority("j"), credentials.authority("j")
    names = {credentials.server_name(c.cert, h) for c in (ca, other) for h in ("a", "b")}
    assert len(names) == 4
    assert all(n.endswith(".jaxps.invalid") and len(n.split(".")[0]) == 32 for n in names)
    issued = credentials.issue(ca, who("worker", 0), hosts=["127.0.0.1"])
    legacy = credentials.TaskCredentials(ca=issued.ca, cert=issued.client_cert, key=issued.key)
    assert legacy.server_name("127.0.0.1") == "127.0.0.1"
    assert legacy.server_cert == legacy.client_cert
