"""How many workers a job may have: the bounds a scale is checked against.

    issued(job)                   -> the workers issued a certificate when the job is created
    capacity(job, issued=...)     -> the most workers it can run now
    within(job, issued=...)       -> the job as the operator runs it (workers at most capacity)
    at_capacity(job)              -> the job with every worker it is issued for (the issuer's)
    refusal(job, workers, ...)    -> why a scale to `workers` is refused, or None
    issued_workers(keys, job)     -> the workers a Secret of credentials holds certificates for

Only workers scale: chief, ps and evaluator counts stay (the CRD refuses a ps change). A job's
certificates are issued once, when it is created, and the CA's key is dropped (`issuer`), so a
worker that was not issued one then can never join: the job is issued workers 0 ..
`maxReplicas`-1, or, without `maxReplicas`, its replicas at creation. What was issued is read
back from the credentials' keys (the Secret on Kubernetes, the work directory locally), so it
is known on every later pass. Pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from jaxps_operator import builders
from jaxps_operator.objects import json_copy

WORKER = "worker"
REPLICAS = "spec.replicaSpecs.worker.replicas"
MAX_FIELD = "spec.replicaSpecs.worker.maxReplicas"
MIN_FIELD = "spec.replicaSpecs.worker.minReplicas"


def _spec(job: Mapping[str, Any]) -> Mapping[str, Any]:
    spec: Mapping[str, Any] = job["spec"]["replicaSpecs"][WORKER]
    return spec


def minimum(job: Mapping[str, Any]) -> int:
    return int(_spec(job).get("minReplicas", 1))


def issued(job: Mapping[str, Any]) -> int:
    """The workers a job is issued certificates for at creation: maxReplicas, else replicas."""
    spec = _spec(job)
    return int(spec.get("maxReplicas") or spec["replicas"])


def capacity(job: Mapping[str, Any], *, issued_workers: int | None) -> int:
    """The most workers the job can run: maxReplicas (or the replicas, before anything is
    issued), never more than the workers issued at creation once that is known."""
    spec = _spec(job)
    top = int(spec.get("maxReplicas") or 0)
    if issued_workers is None:
        return top or int(spec["replicas"])
    return min(top, issued_workers) if top else issued_workers


def within(job: Mapping[str, Any], *, issued_workers: int | None) -> Mapping[str, Any]:
    """`job` as the operator runs it: a copy with the worker replicas cut to the capacity
    when they ask for more (`refusal` says why); `job` itself otherwise."""
    top = capacity(job, issued_workers=issued_workers)
    if int(_spec(job)["replicas"]) <= top:
        return job
    out = json_copy(dict(job))
    out["spec"]["replicaSpecs"][WORKER]["replicas"] = top
    return out


def at_capacity(job: Mapping[str, Any]) -> dict[str, Any]:
    """`job` with as many workers as it is issued certificates for (`issued`)."""
    out = json_copy(dict(job))
    out["spec"]["replicaSpecs"][WORKER]["replicas"] = issued(job)
    return out


def refusal(job: Mapping[str, Any], workers: int, *, issued_workers: int | None) -> str | None:
    """Why the job may not run `workers` workers (naming the field, the value and what is
    allowed), or None. The CRD refuses the same below minReplicas and above maxReplicas; only
    the operator knows what was issued."""
    low = minimum(job)
    top = capacity(job, issued_workers=issued_workers)
    allowed = f"allowed {low}..{top}"
    spec = _spec(job)
    if isinstance(workers, bool) or not isinstance(workers, int):
        return f"{REPLICAS} {workers!r} is not an integer: {allowed}"
    if workers < low:
        return f"{REPLICAS} {workers} is below {MIN_FIELD} {low}: {allowed}"
    if spec.get("maxReplicas") and workers > int(spec["maxReplicas"]):
        return f"{REPLICAS} {workers} is above {MAX_FIELD} {spec['maxReplicas']}: {allowed}"
    if workers > top:
        how = (
            f"{MAX_FIELD} was {issued_workers} then"
            if spec.get("maxReplicas")
            else f"{MAX_FIELD} unset: the replicas at creation"
        )
        return (
            f"{REPLICAS} {workers} is above the {top} workers whose certificates were issued "
            f"when the job was created ({how}): {allowed}; a job that is to grow sets "
            f"{MAX_FIELD} when it is created"
        )
    return None


def issued_workers(keys: Iterable[str], job: Mapping[str, Any]) -> int:
    """The workers the credentials' `keys` (`<pod>.crt`) hold certificates for: the length of
    the run of indexes from 0."""
    pattern = re.compile(
        re.escape(builders.pod_name(job, WORKER, 0)).removesuffix("0") + r"(\d+)\.crt$"
    )
    found = {int(m.group(1)) for k in keys if (m := pattern.match(k))}
    count = 0
    while count in found:
        count += 1
    return count
