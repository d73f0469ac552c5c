"""`make run` until `jaxps local` lands: two ps processes, a pytree pushed and pulled through them.

Starts two ps tasks on 127.0.0.1, initialises a small model's parameters on them (placement by
bytes, the large embedding split across both), runs a few SGD steps of synthetic gradients
through the ps tier while checking every pulled value against the same steps done locally, then
shuts the ps tasks down through the Shutdown RPC and checks that both exited 0.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxps_runtime import launch, optim, placement
from jaxps_runtime.client import PsClient

STEPS = 20
LEARNING_RATE = 0.05


def main() -> int:
    rng = np.random.default_rng(0)
    tree = {
        "embedding": rng.standard_normal((200_000, 16)).astype(np.float32),
        "dense": {
            "kernel": rng.standard_normal((16, 64)).astype(np.float32),
            "bias": np.zeros(64, np.float32),
        },
        "head": {"kernel": rng.standard_normal((64, 10)).astype(np.float32)},
    }
    layout = placement.plan(placement.variables_of(tree), num_ps=2)
    print("placement (greedy by bytes):")
    for shard in layout.shards:
        print(
            f"  ps-{shard.ps}  {shard.name:<24} rows {shard.start}:{shard.stop}  "
            f"{shard.nbytes / 1e6:7.2f} MB"
        )
    print(f"  bytes per ps: {layout.bytes_per_ps()}")
    logs = Path(tempfile.mkdtemp(prefix="jaxps-demo-"))
    ps = launch.LocalPs.start(2, job_id="demo", log_dir=logs)
    print(f"started ps-0 at {ps.addresses[0]}, ps-1 at {ps.addresses[1]} (logs in {logs})")
    try:
        _, named = placement.named_leaves(tree)
        expected = {k: np.array(v) for k, v in named.items()}
        with PsClient(
            addresses=ps.addresses, placement=layout, job_id="demo", task="chief-0"
        ) as client:
            client.init(
                named,
                optimizer=optim.OptimizerConfig("sgd", {"learning_rate": LEARNING_RATE}),
                epoch=1,
            )
            started = time.perf_counter()
            buffers = None
            for step in range(STEPS):
                grads = {
                    k: rng.standard_normal(v.shape).astype(np.float32) for k, v in expected.items()
                }
                client.push(grads, step=step)
                expected = {
                    k: v - np.float32(LEARNING_RATE) * grads[k] for k, v in expected.items()
                }
                ps_step, buffers = client.pull(min_step=step + 1, into=buffers)
                worst = max(float(np.max(np.abs(buffers[k] - expected[k]))) for k in expected)
                print(f"step {ps_step:3d}  max |ps - local| = {worst:.2e}")
                if worst > 1e-5:
                    print("the ps tier disagrees with the local computation", file=sys.stderr)
                    return 1
            seconds = time.perf_counter() - started
            mb = 2 * STEPS * sum(v.nbytes for v in expected.values()) / 1e6
            print(f"{STEPS} steps in {seconds:.2f} s, {mb / seconds:.0f} MB/s pushed and pulled")
            client.shutdown(reason="demo done")
        codes = ps.wait_exit(timeout=30)
        print(f"ps exit codes: {codes}")
        return 0 if codes == [0, 0] else 1
    finally:
        ps.stop()


if __name__ == "__main__":
    sys.exit(main())
