"""The one table from exceptions to messages and exit codes.

Exit codes: 0 ok, 1 user or config error, 2 usage, 3 job failed, 130 interrupted; what
``chameleon run`` exits with for a scheduler (75 requeue me, 93 do not) is in
launcher/exitcodes.py. Every error prints as one line on stderr; a traceback only with
``--debug`` (or CHAMELEON_DEBUG=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import typer

from launcher.exitcodes import JOB_FAILED, OK  # noqa: F401 - the run's codes, one table
from planner.job.errors import ConfigError, LayoutError

USER_ERROR = 1
USAGE = 2
INTERRUPTED = 130


# Typer raises click's exceptions, from its own vendored copy of click in recent versions:
# take the classes from typer so that either works.
ClickException: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)
UsageError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError"
)


class UserError(Exception):
    """Bad input found by a command itself (a missing file, an impossible request)."""


class JobFailed(Exception):
    """The job ran and failed for good; carries the exit code to leave with."""

    def __init__(self, message: str, exit_code: int = JOB_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def check_script(path: str) -> None:
    """A training script named on the command line must be a file."""
    if os.path.isdir(path):
        raise UserError(f"training script is a directory, not a file: {path}")
    if not os.path.isfile(path):
        raise UserError(f"training script not found: {path}")


def writable_dir(flag: str, path: str) -> None:
    """``path`` (a folder a flag names) exists or can be made, and can be written."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot create the folder ({exc.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: the folder is not writable")


@dataclass(frozen=True)
class Rule:
    kinds: tuple[type[BaseException], ...]
    exit_code: int
    prefix: str


RULES = (
    Rule((ConfigError,), USER_ERROR, "config error"),
    Rule((LayoutError,), USER_ERROR, "impossible layout"),
    Rule((UserError, FileNotFoundError, IsADirectoryError, PermissionError), USER_ERROR, "error"),
    Rule((JobFailed,), JOB_FAILED, "job failed"),
    Rule((KeyboardInterrupt,), INTERRUPTED, "interrupted"),
)


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, message lines) for an expected error, None for a bug."""
    for rule in RULES:
        if isinstance(exc, rule.kinds):
            code = exc.exit_code if isinstance(exc, JobFailed) else rule.exit_code
            text = str(exc) or type(exc).__name__
            lines = [f"chameleon: {rule.prefix}: {line}" for line in text.splitlines()]
            return code, "\n".join(lines)
    return None
