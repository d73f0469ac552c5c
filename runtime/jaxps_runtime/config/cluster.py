"""Cluster topology for jaxps: TensorFlow-compatible ``TF_CONFIG`` and TF1 flags.

Standard library only: the Kubernetes operator imports this module without numpy/jax.

Contracts shared by every entry point:

* A cluster maps roles (:data:`ROLES`, TensorFlow's task types) to ``"host:port"`` addresses.
  Roles with no addresses are dropped. There must be a worker or a chief, at most one chief and
  at most one evaluator, and no address may be used by two tasks.
* Every validation failure raises :class:`ClusterSpecError`, whose message names the key path
  or flag (e.g. ``TF_CONFIG.cluster.worker[1]``, ``--task_index``), the offending value and what
  was expected.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import re
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, NoReturn

CHIEF: Final = "chief"
PS: Final = "ps"
WORKER: Final = "worker"
EVALUATOR: Final = "evaluator"
ROLES: Final[tuple[str, ...]] = (CHIEF, PS, WORKER, EVALUATOR)
"""All roles, in the canonical order used for iteration and serialisation."""

TF_CONFIG_ENV: Final = "TF_CONFIG"
DEFAULT_PORT: Final = 2222
DEFAULT_ENVIRONMENT: Final = "cloud"
MAX_PORT: Final = 65535
_MAX_DNS_LABEL: Final = 63
_SHOW_LIMIT: Final = 80

_ALLOWED_ROLES: Final = ", ".join(f'"{r}"' for r in ROLES)
_ADDRESS: Final = '"host:port" with a non-empty host and a port in 1..65535'
_HOST_RE: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_DNS_LABEL_RE: Final = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?")
_MISSING: Final = object()


class ClusterSpecError(ValueError):
    """Invalid cluster description; the message names the key path/flag, value and expectation."""


def _show(value: object) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOW_LIMIT else text[: _SHOW_LIMIT - 3] + "..."


def _fail(path: str, value: object, expected: str) -> NoReturn:
    got = "missing" if value is _MISSING else f"got {_show(value)}"
    raise ClusterSpecError(f"{path}: {got}; expected {expected}")


def _address_key(path: str, value: object) -> str:
    """Validate one address and return a normalised ``host:port`` used to detect duplicates."""
    if not isinstance(value, str) or not value:
        _fail(path, value, f"a non-empty string {_ADDRESS}")
    if value.startswith("["):
        inner, sep, port = value[1:].partition("]:")
        if not sep:
            _fail(path, value, 'a bracketed IPv6 address followed by a port, e.g. "[::1]:2222"')
        try:
            host = ipaddress.IPv6Address(inner).compressed
        except ValueError:
            _fail(path, value, "a valid IPv6 address inside [...]")
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            _fail(path, value, f"{_ADDRESS} (no port found)")
        if not host:
            _fail(path, value, f"{_ADDRESS} (empty host)")
        if ":" in host:
            _fail(path, value, 'IPv6 hosts in brackets, e.g. "[::1]:2222"')
        if not _HOST_RE.fullmatch(host):
            _fail(path, value, "a hostname or IP address made of letters, digits, '.', '-', '_'")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= MAX_PORT):
        _fail(path, value, f"{_ADDRESS} (port must be a number in 1..65535)")
    return f"{host.lower()}:{int(port)}"


def _normalize_cluster(
    raw: object, *, path: str, label: Callable[[str], str]
) -> dict[str, tuple[str, ...]]:
    """Validate a role -> addresses mapping; ``path``/``label(role)`` name it in errors."""
    if not isinstance(raw, Mapping):
        _fail(path, raw, f"an object mapping roles ({_ALLOWED_ROLES}) to address lists")
    seen: dict[str, str] = {}
    jobs: dict[str, tuple[str, ...]] = {}
    for role, addrs in raw.items():
        if role not in ROLES:
            hint = ' (use "chief" instead of the TF1 "master")' if role == "master" else ""
            _fail(label(str(role)), role, f"a role, one of {_ALLOWED_ROLES}{hint}")
        if isinstance(addrs, (str, bytes)) or not isinstance(addrs, Sequence):
            _fail(label(role), addrs, f"a list of {_ADDRESS} strings")
        for i, addr in enumerate(addrs):
            where = f"{label(role)}[{i}]"
            key = _address_key(where, addr)
            if key in seen:
                _fail(where, addr, f"an address not already used by {seen[key]}")
            seen[key] = where
        if addrs:
            jobs[role] = tuple(addrs)
    for role in (CHIEF, EVALUATOR):
        if len(jobs.get(role, ())) > 1:
            _fail(label(role), list(jobs[role]), f"at most one {role} address")
    if WORKER not in jobs and CHIEF not in jobs:
        _fail(path, raw, 'at least one "worker" or "chief" address')
    return {role: jobs[role] for role in ROLES if role in jobs}


@dataclass(frozen=True)
class TaskSpec:
    """One task: a role (one of :data:`ROLES`) and its non-negative index within that role."""

    type: str
    index: int

    def __post_init__(self) -> None:
        if self.type not in ROLES:
            _fail("TaskSpec.type", self.type, f"one of {_ALLOWED_ROLES}")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            _fail("TaskSpec.index", self.index, "a non-negative integer")

    @property
    def device(self) -> str:
        """TensorFlow device name, e.g. ``/job:ps/task:0``."""
        return f"/job:{self.type}/task:{self.index}"

    @property
    def name(self) -> str:
        """Short name, e.g. ``ps-0``."""
        return f"{self.type}-{self.index}"

    def is_chief(self, cluster: ClusterSpec) -> bool:
        """True iff this is ``cluster.chief_task()`` (chief:0, or worker:0 without a chief)."""
        return self == cluster.chief_task()


@dataclass(frozen=True)
class ClusterSpec:
    """Validated, read-only role -> addresses mapping (canonical role order, no empty roles).

    Construct with any ``Mapping[str, Sequence[str]]`` (see :meth:`from_mapping`); it is
    validated (errors are reported under ``cluster.<role>[i]``) and stored normalised.
    """

    jobs: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        jobs = _normalize_cluster(self.jobs, path="cluster", label=lambda r: f"cluster.{r}")
        object.__setattr__(self, "jobs", MappingProxyType(jobs))

    @classmethod
    def from_mapping(cls, jobs: Mapping[str, Sequence[str]]) -> ClusterSpec:
        """Validate and build from role -> addresses (lists or tuples)."""
        return cls(_normalize_cluster(jobs, path="cluster", label=lambda r: f"cluster.{r}"))

    def __hash__(self) -> int:
        return hash(tuple(self.jobs.items()))

    def __reduce__(self) -> tuple[type[ClusterSpec], tuple[dict[str, list[str]]]]:
        return (ClusterSpec, (self.as_dict(),))

    def addresses(self, role: str) -> tuple[str, ...]:
        """Addresses of ``role`` in index order; ``()`` for a known role with no tasks."""
        if role not in ROLES:
            _fail("role", role, f"one of {_ALLOWED_ROLES}")
        return self.jobs.get(role, ())

    def num_tasks(self, role: str) -> int:
        """Number of tasks of ``role`` (0 if absent)."""
        return len(self.addresses(role))

    def address(self, task: TaskSpec) -> str:
        """Address of ``task``; raises :class:`ClusterSpecError` if it is not in the cluster."""
        addrs = self.addresses(task.type)
        if task.index >= len(addrs):
            _fail(task.name, task.index, f"an index below {len(addrs)} for role {task.type!r}")
        return addrs[task.index]

    def tasks(self) -> Iterator[TaskSpec]:
        """All tasks: chief, ps, worker, evaluator, each in index order."""
        for role, addrs in self.jobs.items():
            for index in range(len(addrs)):
                yield TaskSpec(role, index)

    def chief_task(self) -> TaskSpec:
        """chief:0 if the cluster has a chief, else worker:0 (TF1 convention)."""
        return TaskSpec(CHIEF if CHIEF in self.jobs else WORKER, 0)

    def as_dict(self) -> dict[str, list[str]]:
        """A fresh JSON-ready ``{role: [addresses]}`` copy in canonical role order."""
        return {role: list(addrs) for role, addrs in self.jobs.items()}


def _check_task(
    cluster: ClusterSpec, task_type: object, task_index: object, *, paths: tuple[str, str]
) -> TaskSpec:
    """Validate that (task_type, task_index) names a task of ``cluster``; ``paths`` label them."""
    present = ", ".join(f'"{r}"' for r in cluster.jobs)
    if not isinstance(task_type, str) or task_type not in cluster.jobs:
        _fail(paths[0], task_type, f"a role present in the cluster: {present}")
    count = len(cluster.jobs[task_type])
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        _fail(paths[1], task_index, f"an integer (not a boolean) in 0..{count - 1}")
    if not 0 <= task_index < count:
        _fail(paths[1], task_index, f"an index in 0..{count - 1} ({count} {task_type} task(s))")
    return TaskSpec(task_type, task_index)


@dataclass(frozen=True)
class TFConfig:
    """A cluster plus the current task, which must exist in the cluster."""

    cluster: ClusterSpec
    task: TaskSpec
    environment: str = DEFAULT_ENVIRONMENT

    def __post_init__(self) -> None:
        _check_task(
            self.cluster, self.task.type, self.task.index, paths=("task.type", "task.index")
        )
        if not isinstance(self.environment, str):
            _fail("environment", self.environment, "a string")

    def to_json(self) -> str:
        """TensorFlow's TF_CONFIG JSON; roles without replicas are left out."""
        task = {"type": self.task.type, "index": self.task.index}
        doc = {"cluster": self.cluster.as_dict(), "task": task, "environment": self.environment}
        return json.dumps(doc)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            _fail("TF_CONFIG", key, "each JSON object key at most once (duplicate key)")
        result[key] = value
    return result


def parse_tf_config(text: str) -> TFConfig:
    """Parse and strictly validate TF_CONFIG JSON.

    Unknown top-level keys (e.g. ``rpc_layer``) are ignored; ``environment`` is kept when it is a
    string, otherwise ``"cloud"`` is used. Raises :class:`ClusterSpecError` on any problem.
    """
    try:
        doc: object = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ClusterSpecError(
            f"TF_CONFIG: not valid JSON ({exc}); expected a JSON object with "
            '"cluster" and "task" keys'
        ) from exc
    if not isinstance(doc, dict):
        _fail("TF_CONFIG", doc, 'a JSON object with "cluster" and "task" keys')
    jobs = _normalize_cluster(
        doc.get("cluster", _MISSING),
        path="TF_CONFIG.cluster",
        label=lambda role: f"TF_CONFIG.cluster.{role}",
    )
    spec = ClusterSpec(jobs)
    raw_task = doc.get("task", _MISSING)
    if not isinstance(raw_task, dict):
        _fail("TF_CONFIG.task", raw_task, 'an object like {"type": "worker", "index": 0}')
    task = _check_task(
        spec,
        raw_task.get("type", _MISSING),
        raw_task.get("index", _MISSING),
        paths=("TF_CONFIG.task.type", "TF_CONFIG.task.index"),
    )
    env = doc.get("environment")
    return TFConfig(spec, task, env if isinstance(env, str) else DEFAULT_ENVIRONMENT)


class _FlagParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ClusterSpecError(f"TF1 flags: {message}")


def parse_tf1_flags(argv: Sequence[str]) -> tuple[TFConfig, list[str]]:
    """Parse TF1 cluster flags; return the config and the arguments that were not consumed.

    Flags (``--flag=value`` or ``--flag value``): ``--ps_hosts``, ``--worker_hosts``,
    ``--chief_hosts``, ``--evaluator_hosts`` (comma-separated addresses; an empty value means no
    tasks), ``--job_name`` and ``--task_index`` (both required). ``--help`` is not consumed.
    """
    parser = _FlagParser(prog="jaxps", add_help=False, allow_abbrev=False)
    for role in ROLES:
        parser.add_argument(f"--{role}_hosts")
    parser.add_argument("--job_name")
    parser.add_argument("--task_index")
    namespace, rest = parser.parse_known_args(list(argv))
    raw: dict[str, list[str]] = {}
    for role in ROLES:
        value: str | None = getattr(namespace, f"{role}_hosts")
        if value is not None and value.strip():
            raw[role] = [address.strip() for address in value.split(",")]
    spec = ClusterSpec(
        _normalize_cluster(raw, path="--worker_hosts/--chief_hosts", label=lambda r: f"--{r}_hosts")
    )
    job_name: str | None = namespace.job_name
    index_text: str | None = namespace.task_index
    index: object = _MISSING if index_text is None else index_text
    if index_text is not None and re.fullmatch(r"-?[0-9]+", index_text.strip()):
        index = int(index_text)
    task = _check_task(
        spec,
        _MISSING if job_name is None else job_name,
        index,
        paths=("--job_name", "--task_index"),
    )
    return TFConfig(spec, task), rest


def build_tf_config(
    *,
    cluster: Mapping[str, Sequence[str]],
    task_type: str,
    task_index: int,
    environment: str = DEFAULT_ENVIRONMENT,
) -> str:
    """Validate and serialise a TF_CONFIG; ``parse_tf_config`` of the result round-trips."""
    spec = ClusterSpec.from_mapping(cluster)
    task = _check_task(spec, task_type, task_index, paths=("task_type", "task_index"))
    return TFConfig(spec, task, environment).to_json()


def from_env(environ: Mapping[str, str] | None = None) -> TFConfig | None:
    """Parse ``TF_CONFIG`` from ``environ`` (default ``os.environ``); None if unset or blank."""
    text = (os.environ if environ is None else environ).get(TF_CONFIG_ENV, "")
    return parse_tf_config(text) if text.strip() else None


def pod_name(*, job: str, role: str, index: int) -> str:
    """Kubernetes pod name ``<job>-<role>-<index>``; must be a DNS-1123 label (<= 63 chars)."""
    if not isinstance(job, str) or not _DNS_LABEL_RE.fullmatch(job):
        _fail("job", job, "a DNS-1123 label (lowercase letters, digits and '-')")
    if role not in ROLES:
        _fail("role", role, f"one of {_ALLOWED_ROLES}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        _fail("index", index, "a non-negative integer")
    name = f"{job}-{role}-{index}"
    if len(name) > _MAX_DNS_LABEL:
        _fail("job", job, f"a name short enough for pod name {name!r} to fit in 63 characters")
    return name


def dns_address(
    *, job: str, role: str, index: int, namespace: str, port: int = DEFAULT_PORT
) -> str:
    """Address ``<job>-<role>-<index>.<job>.<namespace>.svc:<port>`` (headless service ``job``)."""
    name = pod_name(job=job, role=role, index=index)
    if not isinstance(namespace, str) or not _DNS_LABEL_RE.fullmatch(namespace):
        _fail("namespace", namespace, "a DNS-1123 label (lowercase letters, digits and '-')")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= MAX_PORT:
        _fail("port", port, "an integer in 1..65535")
    return f"{name}.{job}.{namespace}.svc:{port}"


LOG_LEVELS: Final[tuple[str, ...]] = ("DEBUG", "INFO", "WARNING", "ERROR")
BULK_SETTINGS: Final[tuple[str, ...]] = ("on", "off")


def bulk_on(environ: Mapping[str, str]) -> bool:
    """Whether JAXPS_BULK (checked at start) leaves the bulk path on: a ps listens for it, a
    client uses it (`jaxps_runtime.wire.bulk`). "off" keeps Read and Update on gRPC."""
    return environ.get("JAXPS_BULK", "on").lower() != "off"


XLA_THREADS_ENV, PS_XLA_THREADS_ENV = "JAXPS_XLA_THREADS", "JAXPS_PS_XLA_THREADS"
PS_STANDBY_DELAY_ENV = "JAXPS_PS_STANDBY_DELAY"
"""Seconds from a ps's start (or a standby's takeover) to its keeper's next standby."""
LOOP_GRACE_ENV = "JAXPS_LOOP_GRACE_SECONDS"
"""Seconds a user's training loop has to return once the job's outcome is known (`program`)."""
SECONDS_MAX = 3600.0


def xla_threads(environ: Mapping[str, str], *, task_type: str) -> int | None:
    """XLA's intra-op threads for a task of `task_type` (`process.xla.start_cpu_backend`
    starts its CPU backend with them): a ps's JAXPS_PS_XLA_THREADS, 1 unless set; another
    role's JAXPS_XLA_THREADS, None unless set (then the container's CPU limit, `xla.cpu_limit`,
    else XLA's own choice: every CPU the task may use).
    Raises `ClusterSpecError` for a bad count.

    A ps's updates are element-wise and overlap with receiving the next shard; more intra-op
    threads then only compete with its handlers' threads for the cores. Measured with
    bench/transport.py on 2 cores: 64 MiB push through 1 ps 640 -> 1090 MB/s; an Adagrad
    update of the dense mlp's 2.1M-parameter shard 8.9 -> 6.7 ms of CPU.
    """
    name = PS_XLA_THREADS_ENV if task_type == PS else XLA_THREADS_ENV
    value = environ.get(name, "1" if task_type == PS else None)
    if value is None:
        return None
    problem = setting_problem(name, value, task_type=task_type)
    if problem:
        raise ClusterSpecError(problem)
    return int(value)


def setting_problem(name: str, value: str, *, task_type: str) -> str | None:
    """What a task of `task_type` refuses in one of the runtime's own variables that a pod
    template may set (JAXPS_LOG_LEVEL, JAXPS_BULK, JAXPS_METRICS_ADDRESS; JAXPS_PS_XLA_THREADS
    JAXPS_PS_STANDBY and JAXPS_PS_STANDBY_DELAY, read by a ps only; JAXPS_XLA_THREADS and
    JAXPS_LOOP_GRACE_SECONDS, by every other role), as
    "NAME: got ...; expected ...", or None. The runtime exits 2 with it; the control plane
    fails the job with it before any pod starts."""
    if name == "JAXPS_LOG_LEVEL" and value.upper() not in LOG_LEVELS:
        return f"{name}: got {_show(value)}; expected one of {', '.join(LOG_LEVELS)} (any case)"
    if name == "JAXPS_BULK" and value.lower() not in BULK_SETTINGS:
        return (
            f"{name}: got {_show(value)}; expected on (the default: Read and Update on the "
            "bulk path) or off (on gRPC), any case"
        )
    if name == "JAXPS_METRICS_ADDRESS" and not _ip_address(value):
        return (
            f"{name}: got {_show(value)}; expected the IP address the task's metrics and "
            "health port listens on, without brackets or port (default: the pod's IP), e.g. "
            "10.1.2.3, fd00::3, or 0.0.0.0 or :: for all interfaces"
        )
    threads_of = PS_XLA_THREADS_ENV if task_type == PS else XLA_THREADS_ENV  # a role reads one
    if name == threads_of and not (value.isascii() and value.isdigit() and int(value) >= 1):
        unset = (
            "1, the default: one"
            if task_type == PS
            else "unset: its container's CPU limit, else every CPU"
        )
        return (
            f"{name}: got {_show(value)}; expected a thread count >= 1 (XLA's intra-op "
            f"threads for the task's compute, at most the CPUs it may use; {unset})"
        )
    if name == "JAXPS_PS_STANDBY" and task_type == PS and value.lower() not in ("on", "off"):
        return (
            f"{name}: got {_show(value)}; expected on (a standby ps in the pod takes over at "
            "once when the ps is killed; the default on Kubernetes) or off, any case"
        )
    if name == PS_STANDBY_DELAY_ENV and task_type == PS and seconds_setting(value) is None:
        return (
            f"{name}: got {_show(value)}; expected seconds from the ps's start, or a standby's "
            f"takeover, to its next standby's start: a number > 0 and <= {SECONDS_MAX:g} "
            "(default 10)"
        )
    if name == LOOP_GRACE_ENV and task_type != PS and seconds_setting(value) is None:
        return (
            f"{name}: got {_show(value)}; expected the seconds a training.program's loop has "
            "to return once the job's outcome is known, before its process ends with it: a "
            f"number > 0 and <= {SECONDS_MAX:g} (default 30)"
        )
    return None


def seconds_setting(value: str) -> float | None:
    """A setting's seconds (JAXPS_PS_STANDBY_DELAY, JAXPS_LOOP_GRACE_SECONDS); None unless
    0 < seconds <= SECONDS_MAX."""
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 < seconds <= SECONDS_MAX else None


def _ip_address(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


PORTS_FROM = 10_000  # the lowest port `free_ports` hands out
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def port_range(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """The ports `free_ports` picks from, [first, end): PORTS_FROM up to the kernel's
    ephemeral range, or JAXPS_PORTS ("FIRST-LAST", inclusive), which keeps the local jobs
    run side by side on one machine (the process tests' parallel workers) out of each
    other's ports. A value that is no such range is refused, naming it."""
    value = environ.get("JAXPS_PORTS")
    if value is not None:
        first, _, last = value.partition("-")
        try:
            start, stop = int(first), int(last) + 1
        except ValueError:
            start = stop = 0
        if not 1024 <= start < stop <= 65_536:
            raise ValueError(
                f"JAXPS_PORTS: got {value!r}; expected FIRST-LAST, two port numbers from 1024 "
                "to 65535, the first below the last (e.g. 10000-14999)"
            )
        return start, stop
    try:
        low = int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    return PORTS_FROM, low


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now on 127.0.0.1 (every socket stays bound until all are
    picked): the addresses of a cluster on this machine. Picked at random in `port_range()`,
    by default below the kernel's ephemeral range, where no outgoing connection and no other
    process's port-0 bind can be given one before its task binds it (a port the kernel handed
    out was, now and then, taken in between: a task failed with "Address already in use");
    the kernel's own pick where too few are free there."""
    first, low = port_range()
    candidates = random.sample(range(first, low), min(max(low - first, 0), 32 * count))
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) == count:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (or in TIME_WAIT): another
                s.close()
                continue
            socks.append(s)
        while len(socks) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
