"""Fixtures of the cluster tier; they live in harness.py, with the helpers the tests use."""

from tests.cluster.harness import (
    cluster,
    crd,
    jobs,
    operator,
    operator_kubeconfig,
    pytest_runtest_makereport,
)

__all__ = [
    "cluster",
    "crd",
    "jobs",
    "operator",
    "operator_kubeconfig",
    "pytest_runtest_makereport",
]
