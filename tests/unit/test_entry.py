"""`python -m jaxps_runtime`'s own settings: a bad one is a usage error (exit 2) naming the
variable, the value and what is allowed, before anything starts."""

from __future__ import annotations

import pytest

from jaxps_runtime import __main__ as main
from jaxps_runtime.config import cluster


@pytest.mark.parametrize(("value", "level"), [("debug", "DEBUG"), ("Warning", "WARNING")])
def test_the_log_level_from_the_environment_may_be_in_any_case(
    monkeypatch: pytest.MonkeyPatch, value: str, level: str
) -> None:
    monkeypatch.setenv("JAXPS_LOG_LEVEL", value)
    args, _ = main._arguments([])
    assert args.log_level == level


@pytest.mark.parametrize(
    ("setting", "role", "message"),
    [
        (
            ("JAXPS_LOG_LEVEL", "LOUD"),
            "worker",
            'JAXPS_LOG_LEVEL: got "LOUD"; expected one of DEBUG, INFO, WARNING, ERROR',
        ),
        (
            ("JAXPS_BULK", "sometimes"),
            "ps",
            'JAXPS_BULK: got "sometimes"; expected on (the default',
        ),
        (
            ("JAXPS_XLA_THREADS", "0"),
            "worker",
            'JAXPS_XLA_THREADS: got "0"; expected a thread count >= 1',
        ),
        (
            ("JAXPS_PS_XLA_THREADS", "all"),
            "ps",
            'JAXPS_PS_XLA_THREADS: got "all"; expected a thread count >= 1',
        ),
    ],
)
def test_a_bad_setting_in_the_environment_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    setting: tuple[str, str],
    role: str,
    message: str,
) -> None:
    monkeypatch.setenv(*setting)
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, '
        f'"task": {{"type": "{role}", "index": 0}}}}',
    )
    assert main.main([]) == main.EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("environ", "on"),
    [({}, True), ({"JAXPS_BULK": "on"}, True), ({"JAXPS_BULK": "OFF"}, False)],
)
def test_the_bulk_path_is_on_unless_turned_off(environ: dict[str, str], on: bool) -> None:
    assert cluster.bulk_on(environ) is on
    assert (
        cluster.setting_problem("JAXPS_BULK", environ.get("JAXPS_BULK", "on"), task_type="ps")
        is None
    )


@pytest.mark.parametrize("port", ["abc", "70000", "-1", "²", "8080x"])
def test_a_bad_metrics_port_is_a_usage_error_naming_it(port: str) -> None:
    with pytest.raises(cluster.ClusterSpecError, match="JAXPS_METRICS_PORT: got"):
        main._metrics_port({"JAXPS_METRICS_PORT": port})


@pytest.mark.parametrize(("role", "threads"), [("ps", "many"), ("worker", "2")])
def test_xla_threads_are_read_by_the_roles_they_are_for(role: str, threads: str) -> None:
    """JAXPS_XLA_THREADS is a worker's, chief's or evaluator's (a ps reads its own): a ps is
    not refused for it, and a count is taken as it is."""
    assert cluster.setting_problem("JAXPS_XLA_THREADS", threads, task_type=role) is None
    assert cluster.xla_threads({"JAXPS_XLA_THREADS": "2"}, task_type="worker") == 2
    assert cluster.xla_threads({"JAXPS_XLA_THREADS": "2"}, task_type="ps") == 1  # not a ps's
    assert cluster.xla_threads({}, task_type="chief") is None
