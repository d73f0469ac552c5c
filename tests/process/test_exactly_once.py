"""Every record is applied exactly once per data epoch (issue 35), with real `jaxps local` jobs
whose workers are scaled and killed, and whose ps is killed, while they train.

The probe is research/elastic.md §7's counting model (`elastic_user/counting.py`): one
parameter slot per training record, and every applied batch adds exactly 1 to the slot of each
of its records (sign_sgd at learning rate 1 on a loss whose gradient is -1 on those slots), in
every mode. The final parameters therefore say how often each record's gradient is in them,
rollbacks included. Each test runs one scripted sequence through `jaxps local --kill/--scale`
and checks the exported `count`:

1. every record's count is k or k+1 (max - min <= 1): nothing lost, nothing doubled, whatever
   the ledger says;
2. the count is exactly what the ps' own ledger says was applied: each ps holds part of
   `count` (the placement splits it over both ps) and its part of the final checkpoint holds
   its data positions (per shard of the current data epoch, the batches applied there); a
   slot's count must be the epochs completed before plus 1 if its record is in one of those
   batches. The batches' records come from `data.shards.ShardPlan`, the cut every task agrees
   on. The final checkpoint is taken after the workers drained, at the step of the exported
   values (checked: its values are the export);
3. each ps' ledger against its global step (in its checkpoint part), a counter that knows
   nothing of data positions: in async and boundedStaleness every accepted push is one step of
   one full batch, so on every ps the batches its positions hold equal its step, and
   `sum(count) == step * batchSize`; a sync step applies one batch per worker that had one, so
   there `step <= batches <= step * maxReplicas` (a bound; 2. is the exact check).

Each test prints one JSON line (`EXACTLY-ONCE {...}`): the mode, the sequence, the final step,
the visit counts (min, max, sum) and the epochs, to quote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.ps import shardfile
from jaxps_runtime.train import checkpoint
from jaxps_runtime.wire import terms
from tests.process import harness
from tests.process.elastic_user import counting

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parents[2]
USER = Path(counting.__file__).resolve().parent
RUN_TIMEOUT = 240  # seconds for one `jaxps local`; each ends far sooner

RECORDS, BATCH, SEED = 640, 16, 7  # a data epoch: 40 full batches, 20 shards of 2
PLAN = ShardPlan.of(
    counting.make_dataset(records=RECORDS), batch_size=BATCH, seed=SEED
)  # the cut every task of the job computes
STEPS = 620  # async: 15.5 data epochs, the last one ends mid-epoch
EVERY = 50  # checkpoint.everySteps: a ps killed rolls the job back by up to this many steps
COUNT = "['count']"  # the exported leaf, by its pytree path

# The sequence, by the chief's global step when it fires (the local loop acts on the first
# pass, every ~0.25 s, that reads the chief at or past it): 2 workers at the start, of at most
# 4, beside a chief (so that killing worker-0 kills no coordinator).
SEQUENCE = (
    "--kill",
    "worker-1@step=60",  # SIGKILL mid-shard: its lease is taken back, the shard goes on
    "--scale",
    "worker=3@step=150",  # worker-2 joins and takes shards
    "--kill",
    "ps-0@step=330",  # every ps rolls back to the checkpoint of 300, the queue with them
    "--scale",
    "worker=1@step=400",  # worker-2 and worker-1 drain: leases given back, exit 0
    "--kill",
    "worker-0@step=480",  # the last worker SIGKILLed and restarted by the backend
)


@dataclass(frozen=True)
class Run:
    """One finished `jaxps local`: exit code, final status, work directory."""

    code: int
    status: dict[str, Any]
    workdir: Path
    stderr: str

    def log(self, task: str) -> str:
        [path] = self.workdir.glob(f"*-{task}.log")
        return path.read_text(errors="replace")

    def logs(self) -> str:
        """What a failed assertion shows: the status, the progress output, each log's tail."""
        tails = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-5000:]}"
            for p in sorted(self.workdir.glob("*.log"))
        )
        return f"status: {json.dumps(self.status, indent=1)}\n{self.stderr[-3000:]}\n{tails}"


def jaxps_local(tmp_path: Path, manifest: dict[str, Any], *args: str) -> Run:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    workdir = tmp_path / "work"
    argv = [sys.executable, "-m", "jaxps_operator", "local", str(path), "--json"]
    argv += ["--workdir", str(workdir), *args]
    with subprocess.Popen(
        argv,
        env=harness.runtime_env(
            {"PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(USER)])}
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as local:
        try:
            stdout, stderr = local.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            local.terminate()  # SIGTERM: `jaxps local` stops every task it started
            stdout, stderr = local.communicate(timeout=60)
            hung = Run(-1, {}, workdir, stderr)
            pytest.fail(f"jaxps local did not end within {RUN_TIMEOUT} s\n{hung.logs()}")
    status = json.loads(stdout) if stdout.strip().startswith("{") else {}
    return Run(local.returncode, status, workdir, stderr)


def counting_job(mode: str, *, batch_seconds: float, **training: Any) -> dict[str, Any]:
    """The counting model on 2 ps (its vector split over both), 2 workers of at most 4, a
    chief; checkpoints every EVERY steps, the final parameters exported."""
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": f"counting-{mode.lower()}"},
        "spec": {
            "replicaSpecs": {
                "chief": {"replicas": 1},
                "ps": {"replicas": 2},
                "worker": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4},
            },
            "training": {
                "model": {
                    "name": "counting",
                    "module": "counting:make_model",
                    "kwargs": {"records": RECORDS},
                },
                "dataset": {
                    "module": "counting:make_dataset",
                    "kwargs": {"records": RECORDS, "batchSeconds": batch_seconds},
                },
                "mode": mode,
                "steps": STEPS,
                "batchSize": BATCH,
                "seed": SEED,
                "optimizer": {"name": "sign_sgd", "kwargs": {"learning_rate": 1}},
                # 2560 bytes of count: two parts, one on each ps
                "placement": {"minShardBytes": 1024},
                "checkpoint": {"dir": "ckpt", "everySteps": EVERY},
                "exportPath": "export.npz",
                "heartbeatSeconds": 0.25,
                "logEverySeconds": 1,
                "workerTimeoutSeconds": 10,
                **training,
            },
        },
    }


@dataclass(frozen=True)
class Part:
    """One ps's part of the final checkpoint: the slots of `count` it holds (a range of rows),
    their values, its global step and its data positions."""

    ps: int
    rows: tuple[int, int]
    values: np.ndarray
    step: int
    positions: dict[str, int]


def final_parts(run: Run) -> tuple[checkpoint.Manifest, list[Part]]:
    """The newest committed checkpoint, read part by part (the final one: taken at the last
    step after the workers drained)."""
    root = run.workdir / "checkpoints"  # `jaxps local` keeps checkpoint.dir in its workdir
    manifest = checkpoint.committed(root)[0]
    shards = [s for s in manifest.placement["shards"] if s["variable"] == COUNT]
    parts = []
    for record in manifest.shards:
        contents = shardfile.read(
            checkpoint.step_dir(root, manifest.step) / Path(record.file).name,
            expected_sha256=record.sha256,
        )
        [shard] = [s for s in shards if s["ps"] == record.ps]
        values = contents.values[shard["name"]]
        parts.append(
            Part(
                ps=record.ps,
                rows=(int(shard["start"]), int(shard["stop"])),
                values=values,
                step=int(contents.meta["step"]),
                positions=dict(record.cursors),
            )
        )
    return manifest, parts


def applied_by_ledger(positions: dict[str, int]) -> np.ndarray:
    """Per record, how many times the data positions say it was applied: each data epoch
    before the newest they name in full, plus the batches of the newest that they hold."""
    parsed = _parsed(positions)
    epoch = max((e for e, _ in parsed), default=0)
    expected = np.full(RECORDS, epoch, np.int64)
    for (e, shard), cursor in parsed.items():
        if e != epoch:
            continue
        first, _ = PLAN.span(shard)
        for batch in range(first, first + cursor):
            expected[PLAN.rows(e, batch)] += 1
    return expected


def _parsed(positions: dict[str, int]) -> dict[tuple[int, int], int]:
    """Data positions by (epoch, shard)."""
    parsed = {}
    for key, value in positions.items():
        shard = terms.parse_shard_key(key)
        assert shard is not None, key
        parsed[shard] = value
    return parsed


def ledger_batches(positions: dict[str, int]) -> int:
    """How many batches the data positions say were applied: every data epoch before the
    newest they name, in full, and the batches of the newest that they hold."""
    parsed = _parsed(positions)
    epoch = max((e for e, _ in parsed), default=0)
    batches = PLAN.batches
    assert batches is not None
    return epoch * batches + sum(v for (e, _), v in parsed.items() if e == epoch)


@pytest.mark.parametrize(
    ("mode", "extra", "batch_seconds"),
    [
        pytest.param("async", {}, 0.06, id="async"),
        pytest.param("sync", {}, 0.03, id="sync"),
        pytest.param(
            "boundedStaleness",
            {"maxStaleness": 2},
            0.06,
            id="boundedStaleness",
        ),
    ],
)
def test_every_record_is_applied_once_per_epoch_through_kills_and_scaling(
    tmp_path: Path, mode: str, extra: dict[str, Any], batch_seconds: float
) -> None:
    started = time.monotonic()
    run = jaxps_local(tmp_path, counting_job(mode, batch_seconds=batch_seconds, **extra), *SEQUENCE)
    seconds = time.monotonic() - started
    assert run.code == 0, run.logs()
    assert run.status["state"] == "Succeeded", run.logs()
    assert run.status["progress"]["step"] >= STEPS, run.logs()

    with np.load(run.workdir / "export.npz") as exported:
        count = exported[COUNT]
    assert count.shape == (RECORDS,), run.logs()
    visits = count.astype(np.int64)
    assert np.array_equal(visits, count), f"counts not whole: {count}"

    manifest, parts = final_parts(run)
    # The final checkpoint holds the exported values: its positions describe them.
    assert manifest.step == run.status["progress"]["step"], run.logs()
    for part in parts:
        np.testing.assert_array_equal(part.values, count[slice(*part.rows)])
    assert sorted(r for p in parts for r in range(*p.rows)) == list(range(RECORDS))

    report = {
        "mode": mode,
        "sequence": " ".join(SEQUENCE),
        "steps": manifest.step,
        "min": int(visits.min()),
        "max": int(visits.max()),
        "sum": int(visits.sum()),
        "records": RECORDS,
        "epochs": round(float(visits.sum()) / RECORDS, 3),
        "restarts": run.status.get("restarts"),
        "data": run.status["progress"].get("data"),
        "seconds": round(seconds, 1),
    }
    print("EXACTLY-ONCE " + json.dumps(report), flush=True)

    # 1. Nothing lost, nothing doubled: every record k or k+1 times.
    assert visits.max() - visits.min() <= 1, (report, run.logs())
    # 2. Exactly what each ps' ledger says it applied, slot by slot.
    for part in parts:
        ledger = applied_by_ledger(part.positions)
        lo, hi = part.rows
        wrong = np.flatnonzero(visits[lo:hi] != ledger[lo:hi]) + lo
        assert not wrong.size, (
            f"ps-{part.ps}: {wrong.size} records differ from its ledger, e.g. record "
            f"{wrong[0]}: applied {visits[wrong[0]]}, ledger {ledger[wrong[0]]}",
            report,
            run.logs(),
        )
    # 3. Each ps' ledger against its step counter, which knows nothing of positions.
    for part in parts:
        batches = ledger_batches(part.positions)
        if mode == "sync":  # a sync step applies one batch at least, one per worker at most
            assert part.step <= batches <= part.step * 4, (part.ps, part.step, batches, report)
        else:  # one accepted push, one step, one batch
            assert batches == part.step, (part.ps, part.step, batches, report, run.logs())
    if mode != "sync":
        assert {part.step for part in parts} == {manifest.step}, report
        assert visits.sum() == manifest.step * BATCH, (report, run.logs())
