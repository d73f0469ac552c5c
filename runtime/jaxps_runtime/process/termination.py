"""A task's last words for Kubernetes: its container's termination log.

Kubernetes keeps what a container wrote to its `terminationMessagePath` (default
/dev/termination-log, which the kubelet creates) in the pod's status, at most 4096 bytes: that
is where the control plane reads why a task refused its training configuration, and the
chief's final summary. `JAXPS_TERMINATION_LOG` names another file (a test, a pod with another
`terminationMessagePath`). The file is written only when it exists, so nothing is created
outside Kubernetes. Standard library only; one write replaces what was there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV = "JAXPS_TERMINATION_LOG"
DEFAULT_PATH = "/dev/termination-log"
LIMIT_BYTES = 4096  # what Kubernetes keeps of a termination message

log = logging.getLogger(__name__)


def path(environ: Mapping[str, str] = os.environ) -> Path:
    """The termination log: `JAXPS_TERMINATION_LOG`, else Kubernetes' default."""
    return Path(environ.get(ENV) or DEFAULT_PATH)


def message(lines: Sequence[str]) -> str:
    """`lines` one per line (a line's own line breaks become spaces), as many whole lines as fit
    in `LIMIT_BYTES`; a first line longer than that is cut."""
    text = ""
    for line in lines:
        entry = " ".join(line.splitlines()) + "\n"
        if len((text + entry).encode()) > LIMIT_BYTES:
            if not text:
                text = entry.encode()[:LIMIT_BYTES].decode(errors="ignore")
            break
        text += entry
    return text


def write(lines: Sequence[str], *, environ: Mapping[str, str] = os.environ) -> bool:
    """Writes `message(lines)` to the termination log if that file exists; whether it did."""
    file = path(environ)
    if not file.exists():
        return False
    try:
        file.write_text(message(lines))
    except OSError as err:
        log.warning("cannot write %s: %s", file, err)
        return False
    return True
