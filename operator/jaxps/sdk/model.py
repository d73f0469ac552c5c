"""What the SDK returns: typed, read-only views of a TrainingJob, its Events and its logs, and
the errors it raises. Built from the stored job (the same dict on both backends)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jaxps_operator import builders
from jaxps_runtime.config.training import with_defaults


class JaxpsError(Exception):
    """Anything the SDK refuses or cannot do; the message names the job."""


class InvalidManifestError(JaxpsError):
    """The manifest is not a valid TrainingJob; `problems` name each field."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            f"{source}: invalid TrainingJob ({len(problems)} problem"
            f"{'s' if len(problems) != 1 else ''}): " + "; ".join(problems)
        )


class JobNotFoundError(JaxpsError):
    def __init__(self, name: str, where: str) -> None:
        self.name = name
        super().__init__(f"TrainingJob {name} not found in {where}")


class JobExistsError(JaxpsError):
    def __init__(self, name: str, where: str) -> None:
        self.name = name
        super().__init__(f"TrainingJob {name} already exists in {where}; delete it first")


class JobFailedError(JaxpsError):
    """`wait` for a condition the job can no longer reach: it ended otherwise."""

    def __init__(self, job: Job, condition: str) -> None:
        self.job = job
        final = job.condition(job.state)
        why = f" ({final.reason}: {final.message})" if final is not None else ""
        super().__init__(
            f"TrainingJob {job.name} is {job.state}{why}; it will never be {condition}"
        )


class ServerUnreachableError(JaxpsError, ConnectionError):
    """The API server did not answer: nothing listens at its address, the connection broke,
    or no answer came within the request timeout. `server` is its address, `cause` why."""

    def __init__(self, server: str, cause: str) -> None:
        self.server = server
        self.cause = cause
        super().__init__(f"cannot reach the Kubernetes API server at {server}: {cause}")


class ScaleRefusedError(JaxpsError):
    """A scale the job may not have: `why` names the field, the value and what is allowed."""

    def __init__(self, name: str, workers: int, why: str) -> None:
        self.name = name
        self.workers = workers
        self.why = why
        super().__init__(f"TrainingJob {name}: scale to {workers} workers refused: {why}")


class WaitTimeoutError(JaxpsError, TimeoutError):
    def __init__(self, job: Job, condition: str, timeout: float) -> None:
        self.job = job
        super().__init__(
            f"TrainingJob {job.name}: not {condition} after {timeout:g} s; it is "
            f"{job.state or 'Created'} at step {job.progress.step}"
        )


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str
    last_transition: datetime | None

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Condition:
        return cls(
            type=str(raw.get("type", "")),
            status=raw.get("status") == "True",
            reason=str(raw.get("reason", "")),
            message=str(raw.get("message", "")),
            last_transition=parse_time(raw.get("lastTransitionTime")),
        )


@dataclass(frozen=True)
class Progress:
    step: int = 0
    steps: int = 0  # spec.training.steps
    loss: float | None = None
    steps_per_second: float | None = None
    last_checkpoint_step: int | None = None
    eval: Mapping[str, float] = field(default_factory=dict)
    # the chief's shard queue: epoch, shards, shardsDone, shardsLeased, leasesReclaimed
    data: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, raw: Mapping[str, Any], *, steps: int) -> Progress:
        def number(key: str) -> float | None:
            value = raw.get(key)
            return float(value) if isinstance(value, int | float) else None

        checkpoint = number("lastCheckpointStep")
        return cls(
            step=int(raw.get("step") or 0),
            steps=steps,
            loss=number("loss"),
            steps_per_second=number("stepsPerSecond"),
            last_checkpoint_step=int(checkpoint) if checkpoint is not None else None,
            eval={k: float(v) for k, v in (raw.get("eval") or {}).items()},
            data={k: int(v) for k, v in (raw.get("data") or {}).items()},
        )


@dataclass(frozen=True)
class Replicas:
    """One role's pods, as `status.replicaStatuses` counts them."""

    role: str
    replicas: int
    active: int = 0
    ready: int = 0
    succeeded: int = 0
    failed: int = 0
    restarts: int = 0


@dataclass(frozen=True)
class Workers:
    """`status.workers`: the workers the job runs now (`desired`), those running of them,
    those leaving after a scale-down, and the most it can have."""

    desired: int = 0
    active: int = 0
    leaving: int = 0
    max: int = 0

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Workers:
        return cls(**{k: int(raw.get(k) or 0) for k in ("desired", "active", "leaving", "max")})


@dataclass(frozen=True)
class Job:
    name: str
    namespace: str
    uid: str
    state: str  # "" until the first pass, then Created, Running, ..., Succeeded or Failed
    conditions: tuple[Condition, ...]
    progress: Progress
    replicas: tuple[Replicas, ...]
    restarts: int
    start_time: datetime | None
    completion_time: datetime | None
    raw: Mapping[str, Any]  # the stored object, as the backend read it
    workers: Workers = field(default_factory=Workers)

    @property
    def finished(self) -> bool:
        return self.state in ("Succeeded", "Failed")

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Job:
        meta, spec = raw.get("metadata") or {}, raw.get("spec") or {}
        status = raw.get("status") or {}
        counts = status.get("replicaStatuses") or {}
        return cls(
            name=str(meta.get("name", "")),
            namespace=str(meta.get("namespace", "")),
            uid=str(meta.get("uid", "")),
            state=str(status.get("state") or ""),
            conditions=tuple(Condition.of(c) for c in status.get("conditions") or []),
            progress=Progress.of(
                status.get("progress") or {},
                steps=_steps(spec.get("training")),
            ),
            replicas=tuple(
                Replicas(
                    role=role,
                    replicas=int(rs.get("replicas", 1)),
                    **{k: int(counts.get(role, {}).get(k, 0)) for k in _COUNTS},
                )
                for role, rs in (spec.get("replicaSpecs") or {}).items()
            ),
            restarts=int(status.get("restarts") or 0),
            start_time=parse_time(status.get("startTime")),
            completion_time=parse_time(status.get("completionTime")),
            raw=raw,
            workers=Workers.of(status.get("workers") or {}),
        )


_COUNTS = ("active", "ready", "succeeded", "failed", "restarts")


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str
    time: datetime | None
    count: int = 1


@dataclass(frozen=True)
class LogLine:
    task: str  # the pod's name: <job>-<role>-<index>
    text: str  # one line, without its newline


def parse_time(text: Any) -> datetime | None:
    """An RFC 3339 time as Kubernetes writes it; None when absent."""
    if not isinstance(text, str) or not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def task_pods(job: Mapping[str, Any], task: str | None) -> list[str]:
    """The pod names of the job's tasks, or of the one `task` names (`worker-1` or the pod's
    name); `JaxpsError` listing the tasks when it names none."""
    name = job["metadata"]["name"]
    pods = [builders.pod_name(job, r, i) for r, i in builders.tasks(job)]
    if task is None:
        return pods
    pod = task if task in pods else f"{name}-{task}"
    if pod not in pods:
        raise JaxpsError(
            f"TrainingJob {name} has no task {task}; its tasks are "
            f"{', '.join(p.removeprefix(name + '-') for p in pods)}"
        )
    return [pod]


def _steps(training: Any) -> int:
    """`spec.training.steps` as the job runs it: the runtime's default where the manifest has
    none (the apiserver stores no default of spec.training); 0 where it is not a number."""
    steps = with_defaults(training if isinstance(training, Mapping) else {}).get("steps")
    return steps if isinstance(steps, int) else 0
