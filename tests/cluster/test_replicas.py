"""Two replicas of the operator with `--peering`: the holder of the Lease works, the other
watches and waits, and takes over at once when the holder stops (it hands the Lease back).

Each replica runs with the chart's RBAC (the Lease's Role included) and watches one namespace of
its own test; the package's standalone operator may reconcile the same jobs, so what is asserted
is each replica's own count of passes, not who made the pods.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.harness import (
    RELEASE_NAMESPACE,
    Cluster,
    Jobs,
    Operator,
    release,
    wait_for,
)
from tests.cluster.test_operator import mnist

LEASE = "jaxps"


def passes(op: Operator) -> int:
    """The replica's reconcile passes so far (its own Prometheus histogram)."""
    found = re.search(r"^jaxps_operator_reconcile_seconds_count (\S+)$", op.metrics(), re.M)
    return int(float(found.group(1))) if found else 0


def holder(cluster: Cluster) -> str:
    out = cluster.kubectl(
        "get",
        "lease",
        LEASE,
        "--namespace",
        RELEASE_NAMESPACE,
        "-o",
        "jsonpath={.spec.holderIdentity}",
        check=False,
    )
    return out.strip()


@pytest.fixture
def replicas(
    crd: Cluster, operator_kubeconfig: Path, jobs: Jobs, tmp_path: Path
) -> Iterator[dict[str, Operator]]:
    rendered = release("--set", "replicas=2", "--show-only", "templates/leader.yaml")
    crd.kubectl("apply", "-f", "-", stdin=rendered)
    crd.kubectl("delete", "lease", LEASE, "--namespace", RELEASE_NAMESPACE, check=False)
    ops: dict[str, Operator] = {}
    try:
        for name in ("replica-a", "replica-b"):
            ops[name] = Operator(
                operator_kubeconfig,
                tmp_path / f"{name}.log",
                args=(f"--peering={LEASE}", f"--namespace={jobs.namespace}"),
                env={
                    "POD_ID": f"{name}-{uuid.uuid4().hex[:6]}",
                    "POD_NAMESPACE": RELEASE_NAMESPACE,
                },
            )
            ops[name].start()
            if name == "replica-a":  # a holds the Lease before b starts
                wait_for(lambda: holder(crd).startswith("replica-a"), timeout=30, what="a's Lease")
        yield ops
    finally:
        for op in ops.values():
            op.stop()


def test_only_the_lease_holder_reconciles_and_a_standby_takes_over_when_it_stops(
    crd: Cluster, jobs: Jobs, replicas: dict[str, Operator]
) -> None:
    a, b = replicas["replica-a"], replicas["replica-b"]
    jobs.apply(mnist("first"))
    wait_for(lambda: passes(a) > 0, timeout=30, what="a pass by the holder")
    jobs.wait_condition("first", "Created", timeout=60)
    assert passes(b) == 0, f"the standby reconciled:\n{b.tail()}"
    assert holder(crd).startswith("replica-a")

    assert a.stop() == 0  # SIGTERM: a hands the Lease back
    wait_for(lambda: holder(crd).startswith("replica-b"), timeout=15, what="b taking the Lease")
    jobs.apply(mnist("second"))
    wait_for(lambda: passes(b) > 0, timeout=30, what=f"a pass by the new holder:\n{b.tail()}")
    jobs.wait_condition("second", "Created", timeout=60)


def test_a_standby_takes_over_within_15_s_when_the_holder_is_killed(
    crd: Cluster, jobs: Jobs, replicas: dict[str, Operator]
) -> None:
    a, b = replicas["replica-a"], replicas["replica-b"]
    jobs.apply(mnist("first"))
    jobs.wait_condition("first", "Created", timeout=60)
    assert a.process is not None
    a.process.kill()  # SIGKILL: no hand-back, the Lease has to expire
    killed = time.monotonic()
    a.process.wait()
    a.process = None
    wait_for(lambda: holder(crd).startswith("replica-b"), timeout=30, what="b taking the Lease")
    jobs.apply(mnist("second"))
    wait_for(lambda: passes(b) > 0, timeout=30, what=f"a pass by the new holder:\n{b.tail()}")
    failover = time.monotonic() - killed
    print(f"failover after the holder was killed: {failover:.1f} s")
    assert failover <= 15.0, f"failover took {failover:.1f} s"
    jobs.wait_condition("second", "Created", timeout=60)
