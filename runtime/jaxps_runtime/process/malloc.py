"""glibc malloc's settings for a process, set once at its start unless the user tuned malloc.

Two processes tune it: a ps (`ps.start`: keep what an update frees for the next, rather than
fresh pages from the kernel each time) and the operator (`jaxps_operator.controller`: few
arenas, so its threads' freed pages do not stay resident in one arena each). Both leave malloc
as it is when the environment tunes it already (MALLOC_*_ or GLIBC_TUNABLES: the user's choice
wins) or the C library is not glibc. Standard library only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

MALLOC_ENV = (
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "GLIBC_TUNABLES",
)
"""Variables through which a user tunes glibc's malloc: any one set leaves it as it is."""
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt's parameters (malloc.h)


def tune(settings: Mapping[int, int], environ: Mapping[str, str]) -> bool:
    """Applies `settings` (mallopt parameter -> value) to this process's malloc; False where it
    did not: the user tuned malloc in `environ`, the C library is not glibc, or glibc refused
    one (those before it stay applied)."""
    if any(name in environ for name in MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(parameter, value) for parameter, value in settings.items())
