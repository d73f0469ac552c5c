"""The Grafana dashboard the Helm chart ships (charts/jaxps/dashboards/jaxps.json) queries only
metrics jaxps exports, under the names Prometheus stores them, and filters the tasks' metrics by
the labels the operator puts on their pods.

The exported names come from the code, not from a list kept here: the registries of a task's
`process.metrics.Metrics` and of the operator's `jaxps_operator.controller.Metrics` (each
its own registry, so building them here touches no global state). Renaming a metric fails here
until the dashboard follows.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from prometheus_client import CollectorRegistry

from jaxps_operator import builders, controller
from jaxps_runtime.process import metrics as task_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "jaxps" / "dashboards" / "jaxps.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# The names of a family's samples by its type, for a family with none yet (a labelled metric that
# nothing has set, like `jaxps_eval{metric=...}`): what prometheus_client exposes once it has one.
# A type missing here is a KeyError: add it rather than guess.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}


def series_names(registry: CollectorRegistry) -> dict[str, frozenset[str]]:
    """Each family's series as Prometheus stores them: the sample names (a counter's `_total`,
    a histogram's `_bucket`, ...), never a counter's bare family name."""
    return {
        family.name: frozenset(sample.name for sample in family.samples)
        or frozenset(family.name + suffix for suffix in SUFFIXES[family.type])
        for family in registry.collect()
    }


TASK_FAMILIES = series_names(task_metrics.Metrics(task="t").registry)
OPERATOR_FAMILIES = series_names(controller.Metrics().registry)
TASK_METRICS = frozenset[str]().union(*TASK_FAMILIES.values())
EXPORTED = TASK_METRICS.union(*OPERATOR_FAMILIES.values())
JOB_LABEL = re.sub(r"[^A-Za-z0-9_]", "_", builders.LABEL_JOB)
"""The pod label `jaxps.dev/job-name` as Prometheus' Kubernetes discovery names it."""


# --- PromQL: which identifiers are metric names ------------------------------------------------

# Removed before looking for names, in this order: what is quoted (label values, regexes) and
# comments; Grafana variables; label matchers; range and subquery durations; label lists of
# aggregations and vector matching. What is left is functions, keywords, numbers and metrics.
_QUOTED_OR_COMMENT = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`|#[^\n]*')
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\]")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# not after a digit or a dot: the `m` of `5m`, the `e` of `1e3`
_IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = frozenset(
    {
        *("and", "or", "unless", "bool", "offset", "atan2"),
        *("by", "without", "on", "ignoring", "group_left", "group_right"),
        *("inf", "nan"),
    }
)


def metric_names(expr: str) -> frozenset[str]:
    """Every metric name in a PromQL expression: not label names (in matchers, `by (...)`,
    `on (...)`), not functions, keywords, numbers, strings or Grafana variables."""
    for pattern in (_QUOTED_OR_COMMENT, _VARIABLE, _MATCHERS, _RANGE, _LABEL_LIST):
        expr = pattern.sub(" ", expr)
    return frozenset(
        found[1]
        for found in _IDENTIFIER.finditer(expr)
        if not found[2] and found[1].lower() not in _KEYWORDS
    )


class LabelValues(NamedTuple):
    """A Grafana `label_values(series, label)` variable query."""

    series: str  # "" for `label_values(label)`: every series
    label: str


def label_values(query: str) -> LabelValues | None:
    found = re.fullmatch(r"\s*label_values\(\s*(?:(.*),)?\s*(\w+)\s*\)\s*", query, re.DOTALL)
    return None if found is None else LabelValues(series=found[1] or "", label=found[2])


# --- reading the dashboard ----------------------------------------------------------------------


class Query(NamedTuple):
    where: str  # for a person: "panel 'Loss', target A"
    expr: str


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every panel, rows included, and those inside a collapsed row."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: Mapping[str, Any]) -> Iterator[Query]:
    """The panels' PromQL, and the series the template variables read their values from."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            where = f"panel {panel.get('title')!r}, target {target.get('refId')}"
            yield Query(where=where, expr=target.get("expr", ""))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query", "")
        text = query.get("query", "") if isinstance(query, Mapping) else query
        parsed = label_values(text)
        expr = text if parsed is None else parsed.series
        yield Query(where=f"variable {variable.get('name')!r}", expr=expr)


def unknown_metrics(dashboard: Mapping[str, Any], known: frozenset[str]) -> list[str]:
    return [
        f"{query.where} queries {name}, which jaxps does not export{nearest(name, known)}"
        for query in queries(dashboard)
        for name in sorted(metric_names(query.expr) - known)
    ]


def nearest(name: str, known: frozenset[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def variables(dashboard: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


# --- the extractor finds what it should, and the check fails when it should ---------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        pytest.param("jaxps_loss", {"jaxps_loss"}, id="a-bare-name"),
        pytest.param(
            "max by (namespace, jaxps_dev_job_name) "
            '(jaxps_global_step{jaxps_dev_job_name=~"$job"})',
            {"jaxps_global_step"},
            id="label-names-in-matchers-and-by-are-not-metrics",
        ),
        pytest.param(
            "histogram_quantile(0.99, sum by (le) "
            "(rate(jaxps_operator_reconcile_seconds_bucket[$__rate_interval])))",
            {"jaxps_operator_reconcile_seconds_bucket"},
            id="functions-and-ranges-are-not-metrics",
        ),
        pytest.param(
            'label_replace(jaxps_eval, "x", "$1", "metric", "(jaxps_not_a_metric)")',
            {"jaxps_eval"},
            id="strings-are-not-metrics",
        ),
        pytest.param(
            "jaxps_loss offset 5m > bool 1e3 and on (task) group_left(metric) jaxps_eval",
            {"jaxps_loss", "jaxps_eval"},
            id="keywords-durations-and-numbers-are-not-metrics",
        ),
        pytest.param("up == 0", {"up"}, id="a-metric-of-someone-else-is-found-too"),
    ],
)
def test_metric_names_finds_the_metrics_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize(
    ("expr", "unknown"),
    [
        pytest.param('jaxps_global_stp{task="ps-0"}', "jaxps_global_stp", id="a-misspelt-gauge"),
        pytest.param(
            "rate(jaxps_bytes_pushed[5m])", "jaxps_bytes_pushed", id="a-counter-without-_total"
        ),
        pytest.param(
            "histogram_quantile(0.5, rate(jaxps_operator_reconcile_seconds[5m]))",
            "jaxps_operator_reconcile_seconds",
            id="a-histogram-without-_bucket",
        ),
        pytest.param("jaxps_global_step2", "jaxps_global_step2", id="a-name-with-a-digit"),
    ],
)
def test_a_metric_jaxps_does_not_export_is_reported_with_its_panel(expr: str, unknown: str) -> None:
    dashboard = {
        "panels": [{"title": "Global step", "targets": [{"refId": "B", "expr": expr}]}],
    }
    problems = unknown_metrics(dashboard, EXPORTED)
    assert len(problems) == 1
    assert problems[0].startswith(f"panel 'Global step', target B queries {unknown}, ")


def test_exported_names_are_those_prometheus_stores() -> None:
    assert "jaxps_bytes_pushed_total" in TASK_METRICS
    assert "jaxps_bytes_pushed" not in TASK_METRICS  # a counter's family name is no series
    assert "jaxps_eval" in TASK_METRICS  # labelled, and nothing set yet
    assert "jaxps_operator_pod_replacements_total" in EXPORTED  # likewise
    assert "jaxps_operator_reconcile_seconds_bucket" in EXPORTED


# --- the dashboard ----------------------------------------------------------------------------


def test_the_dashboard_is_json_with_datasource_namespace_and_job_variables() -> None:
    dashboard = load()
    assert dashboard["schemaVersion"] >= 39
    found = variables(dashboard)
    assert found["datasource"]["type"] == "datasource"
    assert found["datasource"]["query"] == "prometheus"
    for name in ("namespace", "job"):
        assert found[name]["type"] == "query"
        assert found[name]["datasource"] == DATASOURCE
        # "All" matches series without the label too: a Prometheus that does not copy the
        # pod's labels still shows every job
        assert found[name]["allValue"] == ".*"


def test_the_job_filter_reads_the_pod_label_the_operator_sets() -> None:
    found = variables(load())
    assert label_values(found["namespace"]["query"]["query"]) == LabelValues(
        series="jaxps_global_step", label="namespace"
    )
    job = label_values(found["job"]["query"]["query"])
    assert job is not None
    assert job.label == JOB_LABEL == "jaxps_dev_job_name"


def test_every_panel_has_a_title_a_datasource_and_a_query() -> None:
    problems = []
    ids = []
    for panel in panels(load()):
        ids.append(panel.get("id"))
        if panel.get("type") == "row":  # rows only group panels: they query nothing
            continue
        title = panel.get("title") or f"<the panel with id {panel.get('id')}>"
        if not panel.get("title"):
            problems.append(f"{title} has no title")
        if panel.get("datasource") != DATASOURCE:
            problems.append(f"{title}: datasource {panel.get('datasource')}, not {DATASOURCE}")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{title} has no target")
        problems += [
            f"{title}, target {t.get('refId')}: no expr or a datasource other than {DATASOURCE}"
            for t in targets
            if not t.get("expr") or t.get("datasource") != DATASOURCE
        ]
    assert problems == []
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(map(str, ids))}"


def test_every_query_reads_only_metrics_jaxps_exports() -> None:
    assert unknown_metrics(load(), EXPORTED) == []


def test_every_metric_jaxps_exports_is_on_the_dashboard() -> None:
    """A new metric gets a panel (or a reason here not to)."""
    queried = frozenset[str]().union(*(metric_names(q.expr) for q in queries(load())))
    families = {**TASK_FAMILIES, **OPERATOR_FAMILIES}
    assert sorted(name for name, series in families.items() if not series & queried) == []


def test_every_panel_of_task_metrics_follows_the_namespace_and_job_filters() -> None:
    """The operator's own metrics are the operator's, in its namespace: no filter for them."""
    problems = [
        f"{query.where} reads task metrics without {wanted}"
        for query in queries(load())
        if query.where.startswith("panel ") and metric_names(query.expr) & TASK_METRICS
        for wanted in ('namespace=~"$namespace"', f'{JOB_LABEL}=~"$job"')
        if wanted not in query.expr
    ]
    assert problems == []
