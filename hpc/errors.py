"""The login side's error types, one per kind of failure, each with its exit code.

The CLI prints any ``HpcError`` as one stderr line and exits with its code; anything
else is a bug and may show a traceback. Two kinds matter to a user:

- ``UserError`` (exit 2): bad input (a spec, a flag, a profile); the message names
  the field, the value and what is allowed. Fix the input and run again.
- ``SchedulerError`` (exit 3): the scheduler failed or could not be reached (qsub
  refused the job, squeue hung, sbatch is not installed). The message names the
  command that failed and the last line of its stderr. The input may be fine.
"""

from __future__ import annotations


class HpcError(Exception):
    """Base of the login side's expected failures (never shown with a traceback)."""

    exit_code = 1


class UserError(HpcError):
    """Bad input from the user: names the field, the value and what is allowed."""

    exit_code = 2


class SchedulerError(HpcError):
    """A scheduler client failed or was unreachable; names the command and its last stderr line."""

    exit_code = 3
