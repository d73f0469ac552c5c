"""A job's credentials, issued by the control plane: its CA and one certificate per task.

    issue(job, network) -> {"ca.crt": ..., "<pod>.crt": ..., "<pod>.key": ...}

Each task gets two certificates for one key (`jaxps_runtime.wire.credentials`), both in its
`<pod>.crt`: a client certificate naming its identity `jaxps://<job uid>/<role>/<i>`, and a
server certificate that names neither the job nor the task, only a hash of the job's CA and the
host its peers dial (the host of its address in TF_CONFIG: its DNS name on Kubernetes, 127.0.0.1
locally), which is all a stranger who connects gets to see. The CA's key is dropped once the
tasks are issued: nobody can add a task to the job later, and nothing keeps it. Not pure (fresh
keys); the reconcile pass calls it through the `Cluster` only when the job has no credentials
yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxps_operator import builders
from jaxps_runtime.wire import credentials


def job_id(job: Mapping[str, Any]) -> str:
    """What the tasks know their job as (JAXPS_JOB_UID): its uid, else its name."""
    return str(job["metadata"].get("uid") or job["metadata"]["name"])


def issue(job: Mapping[str, Any], network: builders.Network) -> dict[str, bytes]:
    ca = credentials.authority(job_id(job))
    tasks = builders.tasks(job)
    issued = credentials.issue_many(
        ca,
        [
            (
                credentials.Identity(job=job_id(job), role=role, index=index),
                [network.addresses[role][index].rsplit(":", 1)[0]],
            )
            for role, index in tasks
        ],
    )
    files = {builders.CA_FILE: ca.cert}
    for (role, index), task in zip(tasks, issued, strict=True):
        name = builders.pod_name(job, role, index)
        files[builders.cert_key(name)] = task.cert
        files[builders.key_key(name)] = task.key
    return files
