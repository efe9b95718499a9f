"""User-facing errors. The CLI's single handler turns each into a message, a hint and an exit code.

Exit codes (documented in the README): 0 ok, 1 contract violation / refused action /
failed run, 2 unreadable recipe or usage error, 130 a run stopped by a signal (Ctrl-C, kill).
"""

from __future__ import annotations


class V4LaunchError(Exception):
    """A user mistake or refused action: printed without a traceback.

    Args:
        message: what is wrong (field, value, rule).
        hint: the fix or the next command to run.
        exit_code: process exit code the CLI uses.
    """

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(V4LaunchError):
    """Bad command-line usage or an unreadable / invalid recipe file (exit 2)."""

    exit_code = 2


class RecipeError(UsageError):
    """The recipe cannot be loaded or does not match the schema (exit 2)."""


class ContractViolation(V4LaunchError):
    """The recipe loads but breaks the V4 runtime contract (exit 1)."""


class RefusedError(V4LaunchError):
    """An action was refused to protect a run (unsafe resume, dirty tree, …) (exit 1)."""


class TrainingDiverged(V4LaunchError):
    """A step's loss or gradient norm was not finite: the job stopped before saving it, so the checkpoints on disk
    (``checkpointing.keep_last`` of them) are all from before (exit 1)."""


class InterruptedRun(V4LaunchError):
    """A run stopped by a signal (Ctrl-C, kill) before its workers could save or report a result (exit 130,
    the shell's code for an interrupt): not a failure of the run."""

    exit_code = 130
