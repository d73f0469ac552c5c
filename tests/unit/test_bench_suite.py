"""bench/suite.py's table of a run and its README block (pure helpers; the benches themselves
are run by `make bench`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_suite", Path(__file__).resolve().parents[2] / "bench" / "suite.py"
)
assert _SPEC is not None
assert _SPEC.loader is not None
suite = importlib.util.module_from_spec(_SPEC)  # a script, not a package: loaded by its path
_SPEC.loader.exec_module(suite)


def row(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "bench": "operator",
        "case": "create-1",
        "metric": "seconds",
        "value": 0.1234,
        "unit": "s",
        "baseline": "kubeflow",
        "baseline_value": 0.2,
        "ratio": 1.621,
        "command": "python bench/operator.py --baseline kubeflow",
    }
    base.update(kw)
    return base


def test_every_measurement_is_a_line_with_its_baseline_ratio_and_command() -> None:
    text = suite.table(
        [row(), row(case="usage", value=61234.4, unit="MB", baseline=None, ratio=None)], []
    )
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[2] == (
        "| operator | create-1 | seconds | 0.123 s | kubeflow: 0.2 s "
        "| 1.621\N{MULTIPLICATION SIGN} | `python bench/operator.py --baseline kubeflow` |"
    )
    assert "| 61,234 MB | - | - |" in lines[3]


def test_a_failed_command_is_named_under_the_table() -> None:
    text = suite.table([row()], ["python bench/recovery.py --kubernetes"])
    assert "`python bench/recovery.py --kubernetes` failed" in text


def test_the_table_replaces_only_the_block_between_the_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{suite.BEGIN}\nold table\n{suite.END}\ntail\n")
    suite.write_readme(readme, "new table")
    assert readme.read_text() == f"head\n{suite.BEGIN}\nnew table\n{suite.END}\ntail\n"


def test_a_readme_without_the_markers_is_refused_unchanged(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="bench:begin"):
        suite.write_readme(readme, "new table")
    assert readme.read_text() == "no markers\n"
