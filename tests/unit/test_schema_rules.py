"""The operator compiles every CEL rule of the CRD when it starts, not in the first job's pass."""

from __future__ import annotations

import re
from importlib import resources

from jaxps_operator import schema


def test_every_rule_of_the_crd_is_compiled_up_front() -> None:
    text = (resources.files("jaxps_operator") / "crd/trainingjob.yaml").read_text()
    written = re.findall(r"^\s*- rule: ", text, flags=re.MULTILINE)
    schema._program.cache_clear()

    assert schema.compile_rules() == len(written) > 10
    assert schema._program.cache_info().currsize == len(written)
    # what a pass then evaluates finds each rule compiled: no miss
    misses = schema._program.cache_info().misses
    schema.validate(
        {
            "apiVersion": "jaxps.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "rules"},
            "spec": {
                "replicaSpecs": {"ps": {"replicas": 1}, "worker": {"replicas": 2}},
                "training": {"steps": 10},
            },
        }
    )
    assert schema._program.cache_info().misses == misses
