"""OOM policy (`runPolicy.oomPolicy`, opt-in): a task the kernel killed for memory is replaced
with its role's memory limit raised.

The limit the OOM-killed pod had times `factor`, at most `maxMemory`, becomes the role's
(`status.memory[role]`): every pod of the role made from then on gets it as its memory limit,
and as its request where the template asks one (`builders.pod`). A pod killed at the ceiling,
one without a memory limit (the node's memory ran out, not its own), or a job in a Kueue queue
(its Workload's resources would change, which Kueue admits again or not) is not raised: the job
fails OOMKilled saying why. Without `oomPolicy`, nothing here applies.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from jaxps_operator import kueue
from jaxps_operator.objects import PodState

_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")


def to_bytes(quantity: str) -> int | None:
    """The bytes of a memory quantity as the CRD's pattern allows ("512Mi", "1.5Gi", "2G",
    "1048576"), rounded up; None for anything else."""
    found = _QUANTITY.match(quantity.strip())
    if found is None:
        return None
    number, unit = found.groups()
    return math.ceil(float(number) * _UNITS[unit or ""])


def show(count: int) -> str:
    """Bytes as a quantity: whole Gi or Mi where exact, else Mi rounded up."""
    for unit in ("Gi", "Mi"):
        if count % _UNITS[unit] == 0:
            return f"{count // _UNITS[unit]}{unit}"
    return f"{math.ceil(count / _UNITS['Mi'])}Mi"


def raised(job: Mapping[str, Any], pod: PodState) -> tuple[str | None, str]:
    """(the role's new memory limit, "") for an OOM-killed `pod` under `runPolicy.oomPolicy`,
    or (None, why not): the job then fails OOMKilled with that said. (None, "") without a
    policy."""
    policy = job["spec"]["runPolicy"].get("oomPolicy")
    if not policy:
        return None, ""
    ceiling_text = str(policy["maxMemory"])
    ceiling = to_bytes(ceiling_text)
    factor = float(policy.get("factor", 2))
    queue = ((job.get("metadata") or {}).get("labels") or {}).get(kueue.QUEUE_LABEL)
    if queue:
        return None, (
            f"runPolicy.oomPolicy raises no memory of a job in a Kueue queue ({queue}): its "
            "Workload's resources would change, which Kueue would have to admit again"
        )
    current = to_bytes(pod.memory_limit) if pod.memory_limit else None
    if current is None or ceiling is None:
        return None, "runPolicy.oomPolicy raises a memory limit, and the pod had none"
    if current >= ceiling:
        return None, (
            f"runPolicy.oomPolicy raises it no further: {pod.memory_limit} is at its maxMemory "
            f"({ceiling_text})"
        )
    return show(min(math.ceil(current * factor), ceiling)), ""
