"""What a reconcile pass sees of a job's children, and what it decides to do about them."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from jaxps_operator.conditions import Event

OOM_KILLED = "OOMKilled"
INITIALIZING = "Initializing"
"""Why a pod waits while an init container of the user's runs and has not finished."""
FOREIGN = (
    "holds a name this job needs and is not the job's (no ownerReference with its uid): jaxps "
    "does not adopt, change or delete it; delete or rename it, or give the job another name"
)

T = TypeVar("T")


def json_copy(value: T) -> T:
    """A deep copy of JSON data (what the API server sent, or what a pass built from it): a
    round trip through pickle's C code, 7x faster than `copy.deepcopy` on a TrainingJob
    (34 against 259 us), which was the largest part of every pass. Only this process's own
    objects go through it, never bytes from elsewhere."""
    copied: T = pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    return copied


@dataclass(frozen=True)
class PodState:
    """What is observed of one pod. Every field past `phase` has a default, so a backend that
    cannot see it (local processes are never scheduled nor OOM-killed by a kubelet) leaves it."""

    name: str
    role: str
    index: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    ready: bool = False
    exit_code: int | None = None
    reason: str = ""  # the pod's reason (Evicted), else its main container's terminated reason
    deleting: bool = False
    message: str = ""  # the main container's termination message, once it ended
    metrics: str | None = None  # host:port of its Prometheus metrics while it runs
    container_reason: str = ""  # the main container's terminated reason: OOMKilled, Error, ...
    memory_limit: str | None = None  # the main container's resources.limits.memory, if any
    # Why a Pending pod waits: the scheduler's PodScheduled=False reason (Unschedulable) and
    # words, or its main container's waiting reason (ErrImagePull, ImagePullBackOff, ...)
    waiting_reason: str = ""
    waiting_message: str = ""
    created: datetime | None = None  # creationTimestamp: since when it waits
    failed_init: str = ""  # the init container that failed, ending the pod before its main
    # the pod still runs after its jaxps container ended (a sidecar of the user's that does
    # not exit): `phase` is the task's end, cleanup still takes it for a running pod
    lingering: bool = False
    # Kubernetes ended it, not its task: the DisruptionTarget condition's reason and words
    # (PreemptionByScheduler, TerminationByKubelet, DeletionByTaintManager, ...) or the
    # kubelet's liveness probe (LivenessProbeFailed)
    disruption: str = ""
    # scheduled, its jaxps container not running yet, and nothing said of why (the kubelet
    # may be mounting its volumes: its Warnings are read once it has waited a while)
    starting: bool = False
    # not the job's, nor one of a TrainingJob of the same name that is going: someone else's
    # object with the job's pod name and labels (never adopted: the job fails NameTaken)
    foreign: bool = False
    node: str = ""  # spec.nodeName: where it was scheduled
    uid: str = ""
    # its node is not Ready (the Kubernetes backend reads it for a pod not ready): the node's
    # Ready condition's status, reason and words, and since when (the condition's last change)
    node_lost: str = ""
    node_lost_since: datetime | None = None

    @property
    def oom_killed(self) -> bool:
        """The kernel's OOM killer ended it: its memory limit (or the node's) was too small."""
        return OOM_KILLED in (self.container_reason, self.reason)

    @property
    def task(self) -> str:
        return f"{self.role} {self.index}"


@dataclass
class Plan:
    """What to do: the backend carries it out as it is, in order: delete, then create."""

    create: list[dict[str, Any]] = field(default_factory=list)  # Service and pod manifests
    delete: list[str] = field(default_factory=list)  # pod names
    force: list[str] = field(default_factory=list)  # of `delete`: those deleted at once (grace 0)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    replaced: list[tuple[str, int]] = field(default_factory=list)  # (role, index) of each
    requeue_after: float | None = None  # seconds until the next timer (deadline, TTL)
    delete_job: bool = False

    def wake_in(self, seconds: float) -> None:
        """Asks for another pass within `seconds`: the earliest of the timers set wins."""
        seconds = max(seconds, 0.0)
        if self.requeue_after is None or seconds < self.requeue_after:
            self.requeue_after = seconds
