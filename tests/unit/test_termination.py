"""The termination log: written only where it exists, one line per problem, 4096 bytes at most."""

from __future__ import annotations

from pathlib import Path

from jaxps_runtime.process import termination


def test_lines_are_written_one_per_line_to_the_file_the_environment_names(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")
    env = {termination.ENV: str(log)}
    assert termination.write(["first: bad", "second: also\nbad"], environ=env)
    assert log.read_text() == "first: bad\nsecond: also bad\n"


def test_nothing_is_created_where_there_is_no_termination_log(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    assert not termination.write(["bad"], environ={termination.ENV: str(log)})
    assert not log.exists()


def test_kubernetes_default_path_without_the_variable() -> None:
    assert termination.path({}) == Path("/dev/termination-log")


def test_whole_lines_are_kept_up_to_kubernetes_4096_bytes() -> None:
    lines = [f"{i:04d}:" + "x" * 95 for i in range(100)]  # 101 bytes a line with its newline
    text = termination.message(lines)
    assert len(text.encode()) <= termination.LIMIT_BYTES
    assert text.splitlines() == lines[:40]


def test_a_first_line_longer_than_the_limit_is_cut_on_a_character() -> None:
    text = termination.message(["é" * 3000])
    assert len(text.encode()) <= termination.LIMIT_BYTES
    assert text == "é" * 2048
