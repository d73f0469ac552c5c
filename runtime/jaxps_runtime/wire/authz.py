"""Who may call what: the authorization table of the jaxps services, by the caller's role,
and the one gate every call passes, on gRPC (`rpc.Guard`) and on the bulk path (`bulk`) alike:
both servers hand `admit` the caller and a way to read the request, and send back the
`Refused` it raises.

    admit(gate, method, caller, read, task_of=...) -> the request, or raises Refused
    Gate(job=..., chief=...).refusal(method, caller, claimed) -> Refusal | None
    allowed(method, caller, job=..., chief=...) -> bool

The caller is the identity in its TLS certificate (`credentials.Identity`); a caller of another
job, or with no jaxps identity, may call nothing. The chief is the `chief` task, or worker 0
when the job has none (TF1's rule), whatever role its certificate names. Least privilege:

| service.method | chief | worker | evaluator |
| --- | --- | --- | --- |
| ParameterServer: Init, Assign, Restore, Save, SetWorkers, Shutdown | yes | no | no |
| ParameterServer: Update | yes | yes | no |
| ParameterServer: Status, Read | yes | yes | yes |
| Coordinator: Register, Heartbeat | yes | yes | yes |
| Coordinator: Lease (the shard queue) | yes | yes | no |

A ps calls nobody and is called by nobody of its own kind. Worker 0 acting as chief registers
with its own coordinator, as every training worker does.

A request also names the task it speaks for (`Identity.task`: whose data cursor a push carries,
whose heartbeat says it is alive). That name must be the caller's own certificate identity
(`task_name`: "worker-1"; the chief's is "chief-0", or "worker-0" in a job without a chief task),
so that no task can push, register or heartbeat as another and have a ps or the chief record it.
The gate checks the role before it lets the request be read at all (`claimed` is called only
then), so a caller the table refuses never gets a byte of its request parsed.

In plaintext (`--insecure`, no certificates) no caller has an identity: there is nothing to bind
a request's task to, and any task may speak for any other. That mode is for a trusted network.
Pure; standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from jaxps_runtime.wire.credentials import Identity

T = TypeVar("T")
CHIEF, WORKER, EVALUATOR = "chief", "worker", "evaluator"
PS_SERVICE, COORDINATOR_SERVICE = "jaxps.v1.ParameterServer", "jaxps.v1.Coordinator"

# A refusal's machine-readable reason travels in this trailing-metadata key (on gRPC and on the
# bulk path alike), so that clients act on it rather than on the message text.
REASON_KEY = "jaxps-reason"
_CHIEF_ONLY = frozenset({CHIEF})
_TRAINERS = frozenset({CHIEF, WORKER})
_READERS = frozenset({CHIEF, WORKER, EVALUATOR})
_MEMBERS = frozenset({CHIEF, WORKER, EVALUATOR})

TABLE: Mapping[str, frozenset[str]] = {
    **{
        f"/{PS_SERVICE}/{m}": _CHIEF_ONLY
        for m in ("Init", "Assign", "Restore", "Save", "SetWorkers", "Shutdown")
    },
    **{f"/{PS_SERVICE}/{m}": _TRAINERS for m in ("Update",)},
    **{f"/{PS_SERVICE}/{m}": _READERS for m in ("Status", "Read")},
    **{f"/{COORDINATOR_SERVICE}/{m}": _MEMBERS for m in ("Register", "Heartbeat")},
    **{f"/{COORDINATOR_SERVICE}/{m}": _TRAINERS for m in ("Lease",)},
}


def kind(caller: Identity, *, chief: tuple[str, int]) -> str | None:
    """What the caller counts as: chief, worker or evaluator; None for a ps or anything else."""
    if (caller.role, caller.index) == chief:
        return CHIEF
    if caller.role in (WORKER, EVALUATOR):
        return caller.role
    return None


def allowed(method: str, caller: Identity | None, *, job: str, chief: tuple[str, int]) -> bool:
    """Whether `caller` may call `method` (its full path) of job `job`'s tasks."""
    if caller is None or caller.job != job:
        return False
    who = kind(caller, chief=chief)
    return who is not None and who in TABLE.get(method, frozenset())


def task_name(caller: Identity) -> str:
    """The task name a caller's requests must carry: "<role>-<index>", as `cluster` names it."""
    return f"{caller.role}-{caller.index}"


@dataclass(frozen=True)
class Refusal:
    """Why a call is refused: a gRPC status code's name and details to send back."""

    code: str  # "UNAUTHENTICATED" or "PERMISSION_DENIED" (grpc.StatusCode's names)
    details: str


UNAUTHENTICATED = Refusal("UNAUTHENTICATED", "a jaxps task certificate is required")
NOT_ALLOWED = Refusal("PERMISSION_DENIED", "not allowed")  # says nothing about the job


@dataclass(frozen=True)
class Gate:
    """The authorization of every call a task serves (mutual TLS only). Pure, thread-safe."""

    job: str  # the job's id, as certificates name it
    chief: tuple[str, int]  # (role, index) of the job's chief

    def refusal(
        self, method: str, caller: Identity | None, claimed: Callable[[], str]
    ) -> Refusal | None:
        """None when `caller` (the identity of its verified certificate) may call `method` (its
        full path) with a request naming task `claimed()`; else why not. `claimed` reads the
        request (it may raise the parser's error) and is called only once the caller's role
        may call the method."""
        if caller is None:
            return UNAUTHENTICATED
        if not allowed(method, caller, job=self.job, chief=self.chief):
            return NOT_ALLOWED
        own, named = task_name(caller), claimed()
        if named != own:
            return Refusal(
                "PERMISSION_DENIED",
                f"{method.rpartition('/')[2]}: the request speaks for task {named!r}, but the "
                f"caller's certificate is {own!r}; a task may only speak for itself",
            )
        return None


class Refused(Exception):  # noqa: N818 (the call is refused, as `Refusal` says)
    """A call the gate refused; the server answers with `refusal`'s code and details."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.details)
        self.refusal = refusal


def admit(
    gate: Gate | None,
    method: str,
    caller: Identity | None,
    read: Callable[[], T],
    *,
    task_of: Callable[[T], str],
) -> T:
    """The request of a call to `method` (its full path): `read()`, once `gate` let `caller`'s
    role call the method, and only if the request speaks for the caller's own task
    (`task_of`); `Refused` otherwise. `read` may raise the server's own error for a request
    that does not parse. Without a gate (plaintext: nobody has an identity) the request is
    read and nothing is checked."""
    if gate is None:
        return read()
    request: list[T] = []

    def claimed() -> str:
        request.append(read())
        return task_of(request[0])

    refused = gate.refusal(method, caller, claimed)
    if refused is not None:
        raise Refused(refused)
    return request[0]


def peer_identity(names: Iterable[str | bytes] | None) -> Identity | None:
    """The task a verified peer is: the first jaxps URI among the subject alternative names of
    its certificate, which the TLS handshake checked against the job's CA (as
    `credentials.identity_of` reads a certificate; here without parsing it on every call)."""
    for name in names or ():
        text = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
        found = Identity.parse(text)
        if found is not None:
            return found
    return None
