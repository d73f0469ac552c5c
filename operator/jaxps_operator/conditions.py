"""A TrainingJob's status conditions (Kubernetes' metav1.Condition shape), times and state.

`Status` wraps the status dict a pass computes: `mark` sets a condition (lastTransitionTime
changes only when its status does), `finish` ends the job (Succeeded or Failed, with an Event),
`state` is the one word `kubectl get tj` shows. Pure; one Status per pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

TERMINAL = ("Succeeded", "Failed")
STATES = (
    "Created",
    "Queued",
    "Preempted",
    "Running",
    "Restarting",
    "Suspended",
    "Succeeded",
    "Failed",
)


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


def parse_time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_true(status: Mapping[str, Any], type_: str) -> bool:
    return any(c["type"] == type_ and c["status"] == "True" for c in status.get("conditions", []))


@dataclass
class Status:
    """The status being computed by one pass at `now`, for the job's `generation`."""

    body: dict[str, Any]
    now: datetime
    generation: int
    events: list[Event] = field(default_factory=list)

    def true(self, type_: str) -> bool:
        return is_true(self.body, type_)

    def condition(self, type_: str) -> dict[str, Any] | None:
        """The condition of that type as it stands, or None."""
        conditions: list[dict[str, Any]] = self.body.get("conditions") or []
        return next((c for c in conditions if c["type"] == type_), None)

    @property
    def finished(self) -> bool:
        return self.true("Succeeded") or self.true("Failed")

    def mark(
        self, type_: str, value: bool, reason: str, message: str, *, add: bool = False
    ) -> None:
        """Sets a condition. A False one that did not exist is added only with `add` (when it
        says more than its absence would: PodsReady False because a pod is Unschedulable)."""
        conditions: list[dict[str, Any]] = self.body.setdefault("conditions", [])
        wanted = "True" if value else "False"
        for c in conditions:
            if c["type"] == type_:
                if c["status"] != wanted:
                    c["lastTransitionTime"] = stamp(self.now)
                c.update(
                    status=wanted,
                    reason=reason,
                    message=message,
                    observedGeneration=self.generation,
                )
                return
        if value or add:
            conditions.append(
                {
                    "type": type_,
                    "status": wanted,
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": stamp(self.now),
                    "observedGeneration": self.generation,
                }
            )

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def finish(self, *, succeeded: bool, reason: str, message: str) -> None:
        self.mark("Succeeded" if succeeded else "Failed", True, reason, message)
        for other in ("Running", "Restarting", "PodsReady", "Queued", "Preempted"):
            if self.true(other):
                self.mark(other, False, reason, message)
        self.body["completionTime"] = stamp(self.now)
        self.event("Normal" if succeeded else "Warning", reason, message)

    def state(self) -> str:
        for type_ in ("Failed", "Succeeded", "Suspended", "Preempted", "Queued"):
            if self.true(type_):
                return type_
        for type_ in ("Restarting", "Running"):
            if self.true(type_):
                return type_
        return "Created"
