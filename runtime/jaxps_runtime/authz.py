"""Who may call what: the authorization table of the jaxps services, by the caller's role.

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

A ps calls nobody and is called by nobody of its own kind. Worker 0 acting as chief registers
with its own coordinator, as every training worker does. Pure; standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxps_runtime.credentials import Identity

CHIEF, WORKER, EVALUATOR = "chief", "worker", "evaluator"
PS_SERVICE, COORDINATOR_SERVICE = "jaxps.v1.ParameterServer", "jaxps.v1.Coordinator"

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
