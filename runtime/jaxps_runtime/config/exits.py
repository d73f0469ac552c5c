"""The exit codes by which a task tells the control plane that retrying it is useless, and the
reason the job then fails with. Standard library only."""

from __future__ import annotations

from collections.abc import Mapping

EXIT_INVALID_TRAINING = 78
"""A task's exit code when its training configuration is invalid (sysexits' EX_CONFIG): the
control plane fails the job at once (reason InvalidTraining) and never retries it."""
EXIT_USER_CODE = 79
"""The user's model, dataset or evaluation raised: another pod would raise the same."""
EXIT_DIVERGED = 80
"""The loss, a gradient or an update is not finite (and no rollback is left to try)."""
EXIT_STALLED = 81
"""The global step has not moved for `progressTimeoutSeconds` while the job should train."""
FINAL_EXITS: Mapping[int, str] = {
    EXIT_INVALID_TRAINING: "InvalidTraining",
    EXIT_USER_CODE: "UserCodeError",
    EXIT_DIVERGED: "Diverged",
    EXIT_STALLED: "Stalled",
}
"""Exit codes that end the job at once, whatever the role's restart policy, with the reason
named here; the task's termination log (`termination`) holds the message. A replacement pod
would meet the same cause: retrying only hides it."""
