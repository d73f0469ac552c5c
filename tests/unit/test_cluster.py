"""Unit tests for jaxps_runtime.config.cluster (TF_CONFIG / TF1 flags / Kubernetes naming)."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from jaxps_runtime.config import cluster

FULL_CLUSTER: dict[str, list[str]] = {
    "chief": ["chief-0.svc:2222"],
    "ps": ["ps-0.svc:2222", "ps-1.svc:2222"],
    "worker": ["worker-0.svc:2222", "worker-1.svc:2222", "worker-2.svc:2222"],
    "evaluator": ["eval-0.svc:2222"],
}


def _doc(cluster_spec: object, task: object = None, **extra: object) -> str:
    doc: dict[str, object] = {"cluster": cluster_spec}
    if task is not None:
        doc["task"] = task
    doc.update(extra)
    return json.dumps(doc)


def _raises(text: str) -> str:
    with pytest.raises(cluster.ClusterSpecError) as info:
        cluster.parse_tf_config(text)
    return str(info.value)


# ---------------------------------------------------------------------------- good inputs


def test_full_cluster() -> None:
    config = cluster.parse_tf_config(_doc(FULL_CLUSTER, {"type": "ps", "index": 1}))
    assert config.task == cluster.TaskSpec("ps", 1)
    assert config.environment == "cloud"
    spec = config.cluster
    assert spec.addresses("worker") == tuple(FULL_CLUSTER["worker"])
    assert spec.num_tasks("ps") == 2
    assert spec.num_tasks("evaluator") == 1
    assert spec.address(config.task) == "ps-1.svc:2222"
    assert spec.chief_task() == cluster.TaskSpec("chief", 0)
    assert [t.name for t in spec.tasks()] == [
        "chief-0",
        "ps-0",
        "ps-1",
        "worker-0",
        "worker-1",
        "worker-2",
        "evaluator-0",
    ]
    assert cluster.TaskSpec("chief", 0).is_chief(spec)
    assert not cluster.TaskSpec("worker", 0).is_chief(spec)
    assert spec.as_dict() == FULL_CLUSTER


def test_no_chief_means_worker_zero_is_chief() -> None:
    config = cluster.parse_tf_config(
        _doc({"ps": ["p:1"], "worker": ["w0:1", "w1:1"]}, {"type": "worker", "index": 0})
    )
    assert config.cluster.chief_task() == cluster.TaskSpec("worker", 0)
    assert config.task.is_chief(config.cluster)
    assert not cluster.TaskSpec("worker", 1).is_chief(config.cluster)
    assert config.cluster.addresses("chief") == ()
    assert config.cluster.num_tasks("chief") == 0


def test_chief_only_cluster() -> None:
    config = cluster.parse_tf_config(_doc({"chief": ["c:1"]}, {"type": "chief", "index": 0}))
    assert config.task.is_chief(config.cluster)


def test_ipv6_and_ip_addresses_accepted() -> None:
    spec = {"ps": ["[::1]:2222", "[fe80::1%eth0]:2223"], "worker": ["10.0.0.1:2222"]}
    config = cluster.parse_tf_config(_doc(spec, {"type": "ps", "index": 1}))
    assert config.cluster.address(config.task) == "[fe80::1%eth0]:2223"


def test_unknown_top_level_and_task_keys_tolerated() -> None:
    text = _doc(
        {"worker": ["w:1"]},
        {"type": "worker", "index": 0, "trial": "7"},
        rpc_layer="grpc",
        environment="google",
        something_else={"nested": True},
    )
    config = cluster.parse_tf_config(text)
    assert config.environment == "google"
    assert config.task == cluster.TaskSpec("worker", 0)


def test_non_string_environment_falls_back_to_cloud() -> None:
    text = _doc({"worker": ["w:1"]}, {"type": "worker", "index": 0}, environment=3)
    assert cluster.parse_tf_config(text).environment == "cloud"


def test_empty_role_lists_are_dropped() -> None:
    config = cluster.parse_tf_config(
        _doc({"ps": [], "worker": ["w:1"]}, {"type": "worker", "index": 0})
    )
    assert config.cluster.as_dict() == {"worker": ["w:1"]}


def test_device_and_name() -> None:
    task = cluster.TaskSpec(cluster.PS, 0)
    assert task.device == "/job:ps/task:0"
    assert task.name == "ps-0"
    assert cluster.TaskSpec(cluster.WORKER, 12).device == "/job:worker/task:12"
    assert cluster.ROLES == ("chief", "ps", "worker", "evaluator")


def test_to_json_exact_format_and_role_order() -> None:
    spec = cluster.ClusterSpec.from_mapping({"worker": ["w:1"], "ps": ("p:1",)})
    config = cluster.TFConfig(spec, cluster.TaskSpec("ps", 0))
    assert json.loads(config.to_json()) == {
        "cluster": {"ps": ["p:1"], "worker": ["w:1"]},
        "task": {"type": "ps", "index": 0},
        "environment": "cloud",
    }
    assert list(json.loads(config.to_json())["cluster"]) == ["ps", "worker"]


@pytest.mark.parametrize(
    ("task_type", "task_index"),
    [("chief", 0), ("ps", 1), ("worker", 2), ("evaluator", 0)],
    ids=["chief", "ps", "worker", "evaluator"],
)
def test_build_parse_round_trip(task_type: str, task_index: int) -> None:
    text = cluster.build_tf_config(
        cluster=FULL_CLUSTER, task_type=task_type, task_index=task_index, environment="local"
    )
    parsed = cluster.parse_tf_config(text)
    expected = cluster.TFConfig(
        cluster.ClusterSpec.from_mapping(FULL_CLUSTER),
        cluster.TaskSpec(task_type, task_index),
        "local",
    )
    assert parsed == expected
    assert parsed.to_json() == text
    assert hash(parsed) == hash(expected)


def test_build_rejects_bad_task() -> None:
    with pytest.raises(cluster.ClusterSpecError, match=r"task_index: got 5; expected an index"):
        cluster.build_tf_config(cluster={"worker": ["w:1"]}, task_type="worker", task_index=5)
    with pytest.raises(cluster.ClusterSpecError, match=r'cluster\.ps: got "p:1"; expected a list'):
        cluster.build_tf_config(cluster={"ps": "p:1"}, task_type="ps", task_index=0)


def test_values_are_immutable_and_picklable() -> None:
    config = cluster.parse_tf_config(_doc(FULL_CLUSTER, {"type": "worker", "index": 2}))
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(TypeError):
        config.cluster.jobs["ps"] = ("x:1",)  # type: ignore[index]
    copy = config.cluster.as_dict()
    copy["ps"].append("x:1")
    assert config.cluster.num_tasks("ps") == 2


def test_from_env() -> None:
    text = _doc({"worker": ["w:1"]}, {"type": "worker", "index": 0})
    config = cluster.from_env({"TF_CONFIG": text})
    assert config is not None
    assert config.task == cluster.TaskSpec("worker", 0)
    assert cluster.from_env({}) is None
    assert cluster.from_env({"TF_CONFIG": "  "}) is None
    with pytest.raises(cluster.ClusterSpecError, match="TF_CONFIG"):
        cluster.from_env({"TF_CONFIG": "{"})


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--ps_hosts=p0:1,p1:1",
            "--worker_hosts=w0:1,w1:1",
            "--chief_hosts=c:1",
            "--job_name=ps",
            "--task_index=1",
            "--lr=0.1",
        ],
        [
            "--ps_hosts",
            "p0:1,p1:1",
            "--worker_hosts",
            "w0:1,w1:1",
            "--chief_hosts",
            "c:1",
            "--job_name",
            "ps",
            "--task_index",
            "1",
            "--lr=0.1",
        ],
    ],
    ids=["equals-form", "space-form"],
)
def test_tf1_flags(argv: list[str]) -> None:
    config, rest = cluster.parse_tf1_flags(["train.py", *argv, "--help"])
    assert rest == ["train.py", "--lr=0.1", "--help"]
    assert config.task == cluster.TaskSpec("ps", 1)
    assert config.cluster.as_dict() == {
        "chief": ["c:1"],
        "ps": ["p0:1", "p1:1"],
        "worker": ["w0:1", "w1:1"],
    }


def test_tf1_flags_optional_roles_and_empty_value() -> None:
    config, rest = cluster.parse_tf1_flags(
        ["--ps_hosts=", "--worker_hosts=w:1", "--job_name=worker", "--task_index=0"]
    )
    assert rest == []
    assert config.cluster.as_dict() == {"worker": ["w:1"]}
    assert config.task.is_chief(config.cluster)


def test_kubernetes_names() -> None:
    assert cluster.pod_name(job="mnist", role="ps", index=1) == "mnist-ps-1"
    assert (
        cluster.dns_address(job="mnist", role="worker", index=0, namespace="team-a")
        == "mnist-worker-0.mnist.team-a.svc:2222"
    )
    assert cluster.dns_address(
        job="j", role="chief", index=0, namespace="default", port=5000
    ).endswith(".svc:5000")
    # The generated addresses are themselves valid cluster addresses.
    addrs = [cluster.dns_address(job="j", role="ps", index=i, namespace="ns") for i in range(2)]
    cluster.build_tf_config(cluster={"ps": addrs, "worker": ["w:1"]}, task_type="ps", task_index=1)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"job": "Bad_Job", "role": "ps", "index": 0, "namespace": "ns"}, "job: got"),
        ({"job": "j", "role": "master", "index": 0, "namespace": "ns"}, "role: got"),
        ({"job": "j", "role": "ps", "index": -1, "namespace": "ns"}, "index: got -1"),
        ({"job": "j", "role": "ps", "index": 0, "namespace": "N S"}, "namespace: got"),
        ({"job": "j", "role": "ps", "index": 0, "namespace": "ns", "port": 0}, "port: got 0"),
        ({"job": "j" * 60, "role": "ps", "index": 0, "namespace": "ns"}, "63 characters"),
    ],
    ids=["bad-job", "bad-role", "negative-index", "bad-namespace", "port-zero", "too-long"],
)
def test_kubernetes_names_rejected(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(cluster.ClusterSpecError, match="expected") as info:
        cluster.dns_address(**kwargs)
    assert fragment in str(info.value)


# ---------------------------------------------------------------------------- bad TF_CONFIG

W = {"worker": ["w:1"]}
T = {"type": "worker", "index": 0}

BAD_TF_CONFIGS: list[tuple[str, str, str, str]] = [
    # (id, text, path named in the message, expectation mentioned in the message)
    ("not-json", "{cluster:", "TF_CONFIG:", "expected a JSON object"),
    ("not-object", "[1, 2]", "TF_CONFIG: got [1, 2]", 'with "cluster" and "task"'),
    ("duplicate-key", '{"cluster": {}, "cluster": {}}', "TF_CONFIG:", "at most once"),
    ("missing-cluster", json.dumps({"task": T}), "TF_CONFIG.cluster: missing", "mapping roles"),
    ("cluster-not-object", _doc(["w:1"], T), "TF_CONFIG.cluster: got", "mapping roles"),
    ("master-role", _doc({"master": ["m:1"]}, T), "TF_CONFIG.cluster.master", 'use "chief"'),
    ("unknown-role", _doc({"foo": ["m:1"]}, T), "TF_CONFIG.cluster.foo", '"evaluator"'),
    ("role-not-list", _doc({"worker": "w:1"}, T), "TF_CONFIG.cluster.worker:", "a list of"),
    ("address-not-str", _doc({"worker": ["w:1", 5]}, T), "cluster.worker[1]: got 5", "string"),
    ("no-port", _doc({"worker": ["w:1", "w2"]}, T), "cluster.worker[1]", "no port found"),
    ("port-non-numeric", _doc({"worker": ["w:x"]}, T), "cluster.worker[0]", "1..65535"),
    ("port-zero", _doc({"worker": ["w:0"]}, T), "cluster.worker[0]", "1..65535"),
    ("port-too-big", _doc({"worker": ["w:65536"]}, T), "cluster.worker[0]", "1..65535"),
    ("empty-host", _doc({"worker": [":2222"]}, T), "cluster.worker[0]", "empty host"),
    ("empty-address", _doc({"worker": [""]}, T), "cluster.worker[0]", "non-empty string"),
    ("space-in-host", _doc({"worker": ["a b:1"]}, T), "cluster.worker[0]", "hostname"),
    ("bare-ipv6", _doc({"worker": ["::1:2222"]}, T), "cluster.worker[0]", "in brackets"),
    ("bad-ipv6", _doc({"worker": ["[zz::1]:1"]}, T), "cluster.worker[0]", "valid IPv6"),
    (
        "duplicate-address",
        _doc({"ps": ["h:1"], "worker": ["H:1"]}, T),
        "TF_CONFIG.cluster.worker[0]",
        "not already used by TF_CONFIG.cluster.ps[0]",
    ),
    (
        "two-chiefs",
        _doc({"chief": ["c:1", "c:2"], "worker": ["w:1"]}, T),
        "TF_CONFIG.cluster.chief",
        "at most one chief",
    ),
    (
        "two-evaluators",
        _doc({"evaluator": ["e:1", "e:2"], "worker": ["w:1"]}, T),
        "TF_CONFIG.cluster.evaluator",
        "at most one evaluator",
    ),
    ("no-worker-no-chief", _doc({"ps": ["p:1"]}, T), "TF_CONFIG.cluster:", '"worker" or "chief"'),
    ("missing-task", _doc(W), "TF_CONFIG.task: missing", '{"type": "worker", "index": 0}'),
    ("task-not-object", _doc(W, "worker"), "TF_CONFIG.task: got", "an object"),
    ("task-type-missing", _doc(W, {"index": 0}), "TF_CONFIG.task.type: missing", '"worker"'),
    (
        "task-type-absent-role",
        _doc(W, {"type": "ps", "index": 0}),
        'TF_CONFIG.task.type: got "ps"',
        'a role present in the cluster: "worker"',
    ),
    (
        "task-index-bool",
        _doc(W, {"type": "worker", "index": True}),
        "TF_CONFIG.task.index: got true",
        "not a boolean",
    ),
    (
        "task-index-string",
        _doc(W, {"type": "worker", "index": "0"}),
        'TF_CONFIG.task.index: got "0"',
        "an integer",
    ),
    (
        "task-index-float",
        _doc(W, {"type": "worker", "index": 0.0}),
        "TF_CONFIG.task.index: got 0.0",
        "an integer",
    ),
    (
        "task-index-negative",
        _doc(W, {"type": "worker", "index": -1}),
        "TF_CONFIG.task.index: got -1",
        "0..0",
    ),
    (
        "task-index-out-of-range",
        _doc({"worker": ["a:1", "b:1"]}, {"type": "worker", "index": 2}),
        "TF_CONFIG.task.index: got 2",
        "0..1 (2 worker task(s))",
    ),
    ("task-index-missing", _doc(W, {"type": "worker"}), "TF_CONFIG.task.index: missing", "0..0"),
]


@pytest.mark.parametrize(
    ("text", "path", "expected"),
    [case[1:] for case in BAD_TF_CONFIGS],
    ids=[case[0] for case in BAD_TF_CONFIGS],
)
def test_bad_tf_config(text: str, path: str, expected: str) -> None:
    message = _raises(text)
    assert path in message
    assert "expected" in message
    assert expected in message


def test_error_is_value_error() -> None:
    assert issubclass(cluster.ClusterSpecError, ValueError)


# ---------------------------------------------------------------------------- bad TF1 flags

OK_HOSTS = ["--ps_hosts=p:1", "--worker_hosts=w0:1,w1:1"]

BAD_FLAGS: list[tuple[str, list[str], str, str]] = [
    ("missing-job-name", [*OK_HOSTS, "--task_index=0"], "--job_name: missing", '"ps", "worker"'),
    ("missing-task-index", [*OK_HOSTS, "--job_name=ps"], "--task_index: missing", "0..0"),
    ("job-name-no-value", [*OK_HOSTS, "--job_name"], "--job_name", "expected one argument"),
    ("master-job", [*OK_HOSTS, "--job_name=master", "--task_index=0"], "--job_name", "present"),
    ("index-not-int", [*OK_HOSTS, "--job_name=ps", "--task_index=x"], "--task_index", "integer"),
    ("index-range", [*OK_HOSTS, "--job_name=worker", "--task_index=2"], "--task_index", "0..1"),
    (
        "bad-port",
        ["--worker_hosts=w:1,w:99999", "--job_name=worker", "--task_index=0"],
        "--worker_hosts[1]",
        "1..65535",
    ),
    (
        "trailing-comma",
        ["--worker_hosts=w:1,", "--job_name=worker", "--task_index=0"],
        "--worker_hosts[1]",
        "non-empty",
    ),
    (
        "duplicate-across-flags",
        ["--ps_hosts=w:1", "--worker_hosts=w:1", "--job_name=ps", "--task_index=0"],
        "--worker_hosts[0]",
        "not already used by --ps_hosts[0]",
    ),
    (
        "two-chiefs",
        ["--chief_hosts=c:1,c:2", "--job_name=chief", "--task_index=0"],
        "--chief_hosts",
        "at most one chief",
    ),
    (
        "no-worker-no-chief",
        ["--ps_hosts=p:1", "--job_name=ps", "--task_index=0"],
        "--worker_hosts/--chief_hosts",
        '"worker" or "chief"',
    ),
]


@pytest.mark.parametrize(
    ("argv", "flag", "expected"),
    [case[1:] for case in BAD_FLAGS],
    ids=[case[0] for case in BAD_FLAGS],
)
def test_bad_tf1_flags(argv: list[str], flag: str, expected: str) -> None:
    with pytest.raises(cluster.ClusterSpecError) as info:
        cluster.parse_tf1_flags(argv)
    message = str(info.value)
    assert flag in message
    assert "expected" in message
    assert expected in message


# ---------------------------------------------------------------------------- direct construction


def test_direct_construction_is_validated() -> None:
    with pytest.raises(cluster.ClusterSpecError, match=r"cluster\.worker\[0\]"):
        cluster.ClusterSpec({"worker": ("nope",)})
    with pytest.raises(cluster.ClusterSpecError, match=r"TaskSpec\.index: got -1"):
        cluster.TaskSpec("worker", -1)
    with pytest.raises(cluster.ClusterSpecError, match=r"TaskSpec\.type"):
        cluster.TaskSpec("master", 0)
    spec = cluster.ClusterSpec({"worker": ("w:1",)})
    with pytest.raises(cluster.ClusterSpecError, match=r"task\.type: got \"ps\""):
        cluster.TFConfig(spec, cluster.TaskSpec("ps", 0))
    with pytest.raises(cluster.ClusterSpecError, match=r"worker-3"):
        spec.address(cluster.TaskSpec("worker", 3))
    with pytest.raises(cluster.ClusterSpecError, match=r"role: got \"master\""):
        spec.addresses("master")


def test_free_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    """Below the kernel's ephemeral range no outgoing connection can be given one of them
    before its task binds it (one was: "Address already in use")."""
    import socket
    from pathlib import Path

    ports = cluster.free_ports(64)
    assert len(set(ports)) == 64
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(cluster.PORTS_FROM <= p < low for p in ports)
    for port in ports[:8]:  # free: each binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_keep_to_jaxps_ports_so_runs_side_by_side_share_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("JAXPS_PORTS", "20000-20099")
    ports = cluster.free_ports(40)
    assert len(set(ports)) == 40
    assert all(20_000 <= p <= 20_099 for p in ports)


@pytest.mark.parametrize("value", ["", "20000", "a-b", "20100-20000", "80-90", "60000-70000"])
def test_a_jaxps_ports_that_is_no_range_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ValueError, match=rf"JAXPS_PORTS: got '{value}'; expected FIRST-LAST"):
        cluster.port_range({"JAXPS_PORTS": value})
