"""`make run` until `jaxps local` lands: a real training job on this machine.

2 ps + 2 workers (worker 0 is the chief), sync mode, the `mlp` model on scikit-learn's digits,
each task a `python -m jaxps_runtime` process on 127.0.0.1, exactly as pods would run it.
Shows the chief's step and loss as it goes (read from its Prometheus metrics), then its
summary; the logs of every task stay in the printed directory. Ctrl-C stops every process.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from jaxps_runtime import launch

TRAINING = {
    "model": {"name": "mlp"},
    "dataset": {"name": "digits"},
    "mode": "sync",
    "steps": 400,
    "batchSize": 32,
    "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
}


def _metrics(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("jaxps_") and "{" in line:
            out[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def main() -> int:
    logs = Path(tempfile.mkdtemp(prefix="jaxps-run-"))
    print(f"training: {json.dumps(TRAINING)}")
    print(f"2 ps + 2 workers on 127.0.0.1; logs in {logs}")
    job = launch.LocalJob.start(training=TRAINING, log_dir=logs, ps=2, workers=2)
    try:
        chief = job.processes["worker-0"]
        last = -1.0
        while chief.poll() is None:
            m = _metrics(job.metrics_ports["worker-0"])
            step = m.get("jaxps_global_step", 0.0)
            if step != last and m:
                print(
                    f"  step {int(step):4d}/{TRAINING['steps']}  "
                    f"loss {m.get('jaxps_loss', float('nan')):.4f}  "
                    f"{m.get('jaxps_examples_per_second', 0.0):7.0f} examples/s",
                    flush=True,
                )
                last = step
            time.sleep(1.0)
        codes = job.wait(timeout=60)
        print(f"exit codes: {codes}")
        if any(code != 0 for code in codes.values()):
            print(job.logs(), file=sys.stderr)
            return 1
        summary = job.summary()
        print(f"summary: {json.dumps(summary)}")
        print(
            f"test accuracy {summary['eval']['accuracy']:.3f} after {summary['step']} steps "
            f"in {summary['seconds']:.1f} s"
        )
        return 0
    except KeyboardInterrupt:
        print("interrupted: stopping every task")
        return 130
    finally:
        job.stop()


if __name__ == "__main__":
    sys.exit(main())
