"""The mnist TrainingJob from Python, as in a notebook: create it, wait for it, read its progress.

    python examples/sdk_mnist.py                         # on this machine (the local backend)
    python examples/sdk_mnist.py --kubernetes [-n NS]    # on the cluster of your kubeconfig
                                                         # (PVC mnist-checkpoints in NS)
Each cell below is one SDK call; nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxps.sdk import Client

EXAMPLES = Path(__file__).resolve().parent

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--kubernetes", action="store_true", help="the Kubernetes backend")
parser.add_argument("-n", "--namespace", help="Kubernetes namespace (default: the context's)")
parser.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
parser.add_argument("--root", help="local backend: where jobs live (default ~/.local/share/...)")
parser.add_argument("--keep", action="store_true", help="leave the finished job in place")
args = parser.parse_args()

# %% a client: the same calls on both backends
if args.kubernetes:
    client = Client.kubernetes(namespace=args.namespace, kubeconfig=args.kubeconfig)
else:
    client = Client.local(root=args.root)

# %% create the job from its manifest (a file, YAML text or a dict)
job = client.create(EXAMPLES / "mnist.yaml")
print(f"created TrainingJob {job.name} in {client.backend.where}")

# %% wait for Succeeded (JobFailedError if it fails, WaitTimeoutError after the timeout)
job = client.wait(job.name, "Succeeded", timeout=900)
print(f"{job.name}: {job.state} after {job.progress.step} steps, {job.restarts} restarts")

# %% the final progress, and what happened on the way
print(json.dumps(job.raw["status"]["progress"], indent=2, sort_keys=True))
for event in client.events(job.name):
    print(f"event {event.type} {event.reason}: {event.message}")
last = [line.text for line in client.logs(job.name, "worker-0")][-1]
print(f"worker-0's last log line: {last}")

# %% clean up
if not args.keep:
    client.delete(job.name)
    print(f"deleted {job.name}")
