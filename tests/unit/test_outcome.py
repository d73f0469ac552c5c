"""The causes that end a job (`jaxps_runtime.train.outcome`): what they say and where they point."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from jaxps_runtime.config import training as config
from jaxps_runtime.process import stopping
from jaxps_runtime.train import outcome


@pytest.fixture
def users_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """A module of the user's own, outside jaxps and site-packages, whose function raises
    through a standard library call (the innermost frame is the library's, not the user's)."""
    (tmp_path / "users_model.py").write_text(
        textwrap.dedent(
            """\
            import json


            def loss(params, batch):
                return json.loads(batch)  # line 5: the user's call that raises
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import users_model  # type: ignore[import-not-found]

    yield users_model
    sys.modules.pop("users_model", None)


def test_the_place_is_the_users_innermost_frame_not_the_library_it_called(
    users_module: object,
) -> None:
    with (
        pytest.raises(outcome.UserCodeError) as raised,
        outcome.user_code("the model's loss", task="worker-1"),
    ):
        users_module.loss({}, "{not json")  # type: ignore[attr-defined]
    message = raised.value.message
    assert message.startswith("worker-1: the model's loss raised JSONDecodeError: ")
    assert "users_model.py:5 in loss" in message
    assert raised.value.exit_code == config.EXIT_USER_CODE == 79
    assert raised.value.reason == "UserCodeError"


def test_without_a_users_frame_the_place_is_the_innermost_one() -> None:
    def builtin() -> None:
        raise ValueError("the file went away\nsecond line")

    with (
        pytest.raises(outcome.UserCodeError) as raised,
        outcome.user_code("the dataset's train_batch", task="worker-0"),
    ):
        builtin()
    message = raised.value.message
    assert "raised ValueError: the file went away (at " in message  # first line only
    assert "second line" not in message
    assert "test_outcome.py" in message  # this file is not under jaxps_runtime or the stdlib


def test_a_stopping_task_and_a_cause_already_named_pass_through_unchanged() -> None:
    with pytest.raises(stopping.Stopped), outcome.user_code("the model's loss", task="worker-0"):
        raise stopping.Stopped("SIGTERM")
    diverged = outcome.DivergedError("worker-0: the loss is nan at global step 3")
    with (
        pytest.raises(outcome.DivergedError) as raised,
        outcome.user_code("the model's loss", task="worker-0"),
    ):
        raise diverged
    assert raised.value is diverged


@pytest.mark.parametrize(
    ("cause", "code", "reason"),
    [
        pytest.param(outcome.UserCodeError, 79, "UserCodeError", id="user-code"),
        pytest.param(outcome.DivergedError, 80, "Diverged", id="diverged"),
        pytest.param(outcome.StalledError, 81, "Stalled", id="stalled"),
    ],
)
def test_each_cause_exits_with_a_final_code_the_control_plane_maps_to_its_reason(
    cause: type[outcome.JobFailure], code: int, reason: str
) -> None:
    assert cause.exit_code == code
    assert config.FINAL_EXITS[code] == reason == cause.reason


def test_an_error_carrying_a_host_callbacks_traceback_names_its_last_line_and_the_users_frame(
    tmp_path: Path,
) -> None:
    """JAX raises a host callback's exception as an error whose words are that traceback; the
    message named its first line ("Traceback ...") and jaxps' own frame."""
    users = tmp_path / "mymodel.py"
    words = textwrap.dedent(
        f"""\
        {outcome._TRACEBACK}
          File "{sys.prefix}/lib/python3/site-packages/jax/_src/callback.py", line 90, in cb
            return fn(*args)
          File "{users}", line 29, in on_host
            raise RuntimeError("host callback boom")
        RuntimeError: host callback boom
        """
    )
    said = outcome.describe("the model's loss", ValueError(words))
    assert said.startswith("the model's loss raised ValueError: RuntimeError: host callback boom")
    assert said.endswith(f"(at {users}:29 in on_host)"), said


def test_sys_exit_0_in_users_code_is_a_users_error_and_another_code_passes_through() -> None:
    program = outcome.user_code("training.program 'p:main'", task="worker-0")
    exit_0 = pytest.raises(outcome.UserCodeError, match=r"raised SystemExit: 0 .*sys.exit before")
    with exit_0, program:
        sys.exit(0)
    failing = outcome.user_code("training.program 'p:main'", task="worker-0")
    with pytest.raises(SystemExit) as exited, failing:
        sys.exit(3)
    assert exited.value.code == 3
