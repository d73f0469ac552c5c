"""What a reconcile pass sees of a job's children, and what it decides to do about them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxps_operator.conditions import Event


@dataclass(frozen=True)
class PodState:
    """What is observed of one pod."""

    name: str
    role: str
    index: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    ready: bool = False
    exit_code: int | None = None
    reason: str = ""
    deleting: bool = False
    message: str = ""  # the main container's termination message, once it ended
    metrics: str | None = None  # host:port of its Prometheus metrics while it runs


@dataclass
class Plan:
    """What to do: the backend carries it out as it is, in order: delete, then create."""

    create: list[dict[str, Any]] = field(default_factory=list)  # Service and pod manifests
    delete: list[str] = field(default_factory=list)  # pod names
    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    replaced: list[tuple[str, int]] = field(default_factory=list)  # (role, index) of each
    requeue_after: float | None = None  # seconds until the next timer (deadline, TTL)
    delete_job: bool = False
