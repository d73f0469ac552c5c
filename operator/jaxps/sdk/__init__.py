"""The jaxps Python SDK: TrainingJobs from Python and notebooks, on Kubernetes or locally.

    from jaxps.sdk import Client

    client = Client.local()                 # or Client.kubernetes(namespace="team-a")
    job = client.create("examples/mnist.yaml")
    job = client.wait(job.name, timeout=600)
    print(job.state, job.progress.step, job.progress.eval)
    client.scale(job.name, workers=4)       # workers join or drain; ScaleRefusedError says why not

No JAX, numpy or gRPC is imported.
"""

from jaxps.sdk.client import CONDITIONS, Backend, Client, load
from jaxps.sdk.model import (
    Condition,
    Event,
    InvalidManifestError,
    JaxpsError,
    Job,
    JobExistsError,
    JobFailedError,
    JobNotFoundError,
    LogLine,
    Progress,
    Replicas,
    ScaleRefusedError,
    ServerUnreachableError,
    WaitTimeoutError,
    Workers,
)

__all__ = [
    "CONDITIONS",
    "Backend",
    "Client",
    "Condition",
    "Event",
    "InvalidManifestError",
    "JaxpsError",
    "Job",
    "JobExistsError",
    "JobFailedError",
    "JobNotFoundError",
    "LogLine",
    "Progress",
    "Replicas",
    "ScaleRefusedError",
    "ServerUnreachableError",
    "WaitTimeoutError",
    "Workers",
    "load",
]
