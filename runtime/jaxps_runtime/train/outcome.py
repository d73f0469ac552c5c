"""Why a task ends its whole job, not just itself: the causes no replacement pod would cure.

A task that meets one raises a `JobFailure`; `roles` logs it, writes its `message` to the
termination log (`termination`: what the control plane reads) and exits with its `exit_code`,
one of `config.FINAL_EXITS`: the job fails at once with that reason, whatever the restart
policy, never retried.

- `UserCodeError`: the user's model, dataset or evaluation raised (`user_code` wraps each call
  into them); the message names the call, the exception's type and words, and the place
  (file:line of the innermost frame that is the user's, not jaxps', JAX's or the standard
  library's).
- `DivergedError`: a loss, gradient or update is not finite, naming the step and the task.
- `StalledError`: the global step has not moved for `training.progressTimeoutSeconds`, naming
  what each task was waiting for.

Standard library only; pure but for `user_code`'s re-raise.
"""

from __future__ import annotations

import re
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import ClassVar

from jaxps_runtime.config import training as config

_RUNTIME = str(Path(__file__).resolve().parents[1])  # the whole jaxps_runtime package
# Frames from here are never "the user's": the interpreter's library, installed packages, jaxps.
_NOT_USERS = tuple(
    {
        _RUNTIME,
        sysconfig.get_path("stdlib"),
        sysconfig.get_path("platstdlib"),
        sysconfig.get_path("purelib"),
        sysconfig.get_path("platlib"),
    }
)


class JobFailure(Exception):  # noqa: N818 - the base of the *Error causes
    """A cause that ends the job: another pod would meet it again."""

    exit_code: ClassVar[int]
    reason: ClassVar[str]

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidDataError(JobFailure):
    """The job's data does not fit its model (a label outside the classifier's classes)."""

    exit_code = config.EXIT_INVALID_TRAINING
    reason = config.FINAL_EXITS[config.EXIT_INVALID_TRAINING]


class InvalidTrainingError(JobFailure):
    """The training configuration does not fit the model (found only once it is built: a
    dynamic table the model does not read by ids)."""

    exit_code = config.EXIT_INVALID_TRAINING
    reason = config.FINAL_EXITS[config.EXIT_INVALID_TRAINING]


class UserCodeError(JobFailure):
    exit_code = config.EXIT_USER_CODE
    reason = config.FINAL_EXITS[config.EXIT_USER_CODE]


class DivergedError(JobFailure):
    exit_code = config.EXIT_DIVERGED
    reason = config.FINAL_EXITS[config.EXIT_DIVERGED]


class StalledError(JobFailure):
    exit_code = config.EXIT_STALLED
    reason = config.FINAL_EXITS[config.EXIT_STALLED]


def _is_users(filename: str) -> bool:
    if filename.startswith("<"):  # <string>, <frozen ...>: generated, not a user's file
        return False
    resolved = str(Path(filename).resolve())
    return not any(resolved.startswith(root) for root in _NOT_USERS if root)


def place(tb: TracebackType | None) -> str:
    """Where an exception was raised, as `file:line in function`: the innermost frame of the
    user's own files; else the innermost frame of all (a built-in model's or dataset's)."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return "an unknown place"
    users = [f for f in frames if _is_users(f.filename)]
    frame = (users or frames)[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def describe(what: str, err: BaseException) -> str:
    """One line: what raised, the exception's type and first line of words, and where. An
    error that carries another's traceback as its words (JAX's for a host callback that
    raised) is told by that one's last line and its innermost frame of the user's."""
    text = str(err).strip()
    words, where = text.splitlines(), place(err.__traceback__)
    if _TRACEBACK in text:
        inner = text[text.index(_TRACEBACK) :].splitlines()
        last = [line.strip() for line in inner[1:] if line.strip() and not line.startswith(" ")]
        frames = [m for m in _FRAME.finditer(text) if _is_users(m["file"])]
        words = last[-1:] or words
        if frames:
            where = f"{frames[-1]['file']}:{frames[-1]['line']} in {frames[-1]['name']}"
    said = f": {words[0]}" if words else ""
    return f"{what} raised {type(err).__name__}{said} (at {where})"


@contextmanager
def user_code(what: str, *, task: str) -> Iterator[None]:
    """Runs a call into the user's model, dataset or evaluation: any exception it raises
    becomes a `UserCodeError` naming `what`, the task and the place. A task being stopped
    (`stopping.Stopped`, a BaseException) and a `JobFailure` pass through as they are; so
    does `sys.exit` with an exit code that fails the task, while `sys.exit(0)` (or None),
    which would end the process as if training were over, is a `UserCodeError` too."""
    try:
        yield
    except JobFailure:
        raise
    except SystemExit as err:
        if err.code not in (0, None):
            raise
        raise UserCodeError(
            f"{task}: {describe(what, err)}: a task ends once training is over, and sys.exit "
            "before that would report a job that did not train as succeeded"
        ).with_traceback(sys.exc_info()[2]) from err
    except Exception as err:
        raise UserCodeError(f"{task}: {describe(what, err)}").with_traceback(
            sys.exc_info()[2]
        ) from err
