"""glibc malloc's settings (`process.malloc`): taken unless the user tuned malloc, in the ps and
in the operator alike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxps_operator import controller
from jaxps_runtime.process import malloc


def test_the_operator_bounds_its_arenas_unless_the_user_tuned_malloc() -> None:
    # glibc (this machine, the image): taken; in a fresh interpreter, so that this one's malloc
    # is left as it was
    code = "import os\nfrom jaxps_operator import controller as c\nprint(c.fewer_arenas({}))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={k: v for k, v in os.environ.items() if k not in malloc.MALLOC_ENV},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "True", done.stderr
    assert controller.fewer_arenas({"MALLOC_ARENA_MAX": "8"}) is False


@pytest.mark.parametrize("name", malloc.MALLOC_ENV)
def test_a_users_malloc_setting_wins_over_ours(name: str) -> None:
    assert malloc.tune({malloc.M_ARENA_MAX: 2}, {name: "4"}) is False
