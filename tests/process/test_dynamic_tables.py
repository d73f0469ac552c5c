"""A dynamic embedding table (`training.embeddings`) keeps exactly once through kills and
rescales (issue 58): the counting model on a table keyed by 64-bit hashes
(`elastic_user/dyncounting.py`), whose every applied batch adds exactly 1 to the row of each of
its records, run by `jaxps local` while workers join, leave and are SIGKILLed and a ps is
SIGKILLed. The rows are read from the final checkpoint (a dynamic table is checkpointed by id
in each ps's part; it is not exported), and every record's count
must be what that ps's own ledger (its data positions) says was applied, as test_exactly_once
checks for a fixed vector; every id on the ps its hash names. Then a job of 3 ps resumes from
the same checkpoint.dir: the chief cuts it for 3 ps (`train.reshard`), and the counts stay
exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jaxps_runtime.ps import shardfile
from jaxps_runtime.train import checkpoint
from jaxps_runtime.wire import tables
from tests.process.elastic_user import dyncounting
from tests.process.test_exactly_once import (
    BATCH,
    RECORDS,
    Run,
    applied_by_ledger,
    counting_job,
    jaxps_local,
)

pytestmark = pytest.mark.process
STEPS = 400
TABLE = "['count']"
SEQUENCE = (
    "--kill",
    "worker-1@step=60",  # its lease is taken back; a push it sent is never applied twice
    "--scale",
    "worker=3@step=120",  # worker-2 joins and takes shards
    "--kill",
    "ps-1@step=180",  # every ps rolls back to the checkpoint of 150: the table's parts too
    "--scale",
    "worker=2@step=240",  # worker-2 drains: its leases given back
    "--kill",
    "worker-0@step=300",
)


def dynamic_job(steps: int = STEPS) -> dict[str, Any]:
    job = counting_job("async", batch_seconds=0.06)
    spec = job["spec"]["training"]
    spec["model"] = {"name": "dyncounting", "module": "dyncounting:make_model"}
    spec["dataset"]["module"] = "dyncounting:make_dataset"
    spec["steps"] = steps
    # each ps holds maxRows / 2: twice the records, as the hash need not split them evenly
    spec["embeddings"] = {"count": {"dim": 1, "maxRows": 2 * RECORDS, "initializer": {"scale": 0}}}
    del spec["exportPath"], spec["placement"]
    job["metadata"]["name"] = "dyncounting"
    return job


def test_every_admitted_ids_count_is_exact_through_kills_and_onto_more_ps(
    tmp_path: Path,
) -> None:
    run = jaxps_local(tmp_path, dynamic_job(), *SEQUENCE)
    exact_counts(run, num_ps=2, steps=STEPS)
    summary = run.log("chief-0")
    assert '"embeddings"' in summary, summary[-3000:]
    assert '"hitRate"' in summary, summary[-3000:]
    # The same checkpoint.dir, a job of 3 ps: the table's rows re-partitioned by the hash
    more = dynamic_job(steps=STEPS + 80)
    more["spec"]["replicaSpecs"]["ps"]["replicas"] = 3
    again = jaxps_local(tmp_path, more)
    assert "cut the checkpoint of step" in again.log("chief-0"), again.logs()
    exact_counts(again, num_ps=3, steps=STEPS + 80)


def exact_counts(run: Run, *, num_ps: int, steps: int) -> None:
    """Every record's row in the final checkpoint, on the ps its id's hash names, holds what
    that ps's ledger says was applied; every record admitted; one batch per step."""
    assert run.code == 0, run.logs()
    assert run.status["state"] == "Succeeded", run.logs()
    root = run.workdir / "checkpoints"
    manifest = checkpoint.committed(root)[0]
    assert manifest.step >= steps, run.logs()
    assert manifest.placement.get("dynamic") == [TABLE]
    keys = dyncounting.keys(RECORDS)
    position = {int(k): i for i, k in enumerate(keys)}
    visits = np.full(RECORDS, -1, np.int64)
    ledger = np.full(RECORDS, -1, np.int64)
    assert len(manifest.shards) == num_ps
    for record in manifest.shards:
        contents = shardfile.read(
            checkpoint.step_dir(root, manifest.step) / Path(record.file).name,
            expected_sha256=record.sha256,
        )
        part = contents.tables[f"{TABLE}/{record.ps}"]
        assert int(contents.meta["step"]) == manifest.step
        # every id on the ps its hash names, each once, values whole
        assert (tables.owner(part["keys"], num_ps) == record.ps).all()
        assert len(set(part["keys"].tolist())) == part["keys"].size
        mine = [position[int(k)] for k in part["keys"]]
        visits[mine] = part["values"][:, 0]
        theirs = np.flatnonzero(tables.owner(keys, num_ps) == record.ps)
        ledger[theirs] = applied_by_ledger(dict(record.cursors))[theirs]
    report = {
        "ps": num_ps,
        "steps": manifest.step,
        "min": int(visits.min()),
        "max": int(visits.max()),
        "sum": int(visits.sum()),
        "restarts": run.status.get("restarts"),
    }
    print("DYNAMIC-EXACTLY-ONCE " + json.dumps(report), flush=True)
    assert (visits >= 1).all(), (report, run.logs())  # every record admitted (minCount 1)
    wrong = np.flatnonzero(visits != ledger)
    assert not wrong.size, (
        f"{wrong.size} records differ from their ps's ledger, e.g. record {wrong[0]}: "
        f"applied {visits[wrong[0]]}, ledger {ledger[wrong[0]]}",
        report,
        run.logs(),
    )
    assert visits.max() - visits.min() <= 1, report
    assert visits.sum() == manifest.step * BATCH, (report, run.logs())
