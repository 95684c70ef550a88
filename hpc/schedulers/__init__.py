"""Schedulers behind one small interface: submit, status, cancel, parse ids.

``pbs.PBS``, ``slurm.Slurm`` and ``local.Local`` each provide::

    submit_command(script) -> argv        # what ``--dry-run`` prints
    submit(script, run_dir) -> job id     # runs the submit command
    parse_job_id(stdout) -> job id
    status(job_id) -> one of STATES
    cancel(job_id) -> None

States are normalized so that callers never see scheduler-specific letters.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any, Protocol

from hpc.errors import UserError

STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "UNKNOWN")


class SchedulerError(UserError):
    """The scheduler refused or failed a request (its own message is included)."""


class Scheduler(Protocol):
    """The interface every scheduler module implements."""

    name: str

    def submit_command(self, script: str) -> list[str]: ...
    def submit(self, script: str, run_dir: str, on_start: Any = None) -> str: ...
    def parse_job_id(self, stdout: str) -> str: ...
    def status(self, job_id: str) -> str: ...
    def cancel(self, job_id: str) -> None: ...


def run(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run a scheduler client; a missing executable is a SchedulerError, not a traceback."""
    if shutil.which(argv[0]) is None:
        raise SchedulerError(f"scheduler: {argv[0]} not found on PATH; allowed: run on a login node "
                             "that has it, or use --dry-run")
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"scheduler: {' '.join(argv)} did not answer within {timeout:.0f} s") from None


def last_line(text: str) -> str:
    """The last non-empty line of a client's message, for one-line errors."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no message)"


def get(name: str) -> Scheduler:
    """The scheduler for a profile's ``scheduler`` value."""
    if name == "pbs":
        from hpc.schedulers.pbs import PBS

        return PBS()
    if name == "slurm":
        from hpc.schedulers.slurm import Slurm

        return Slurm()
    if name == "local":
        from hpc.schedulers.local import Local

        return Local()
    raise UserError(f"scheduler: {name!r} is not known; allowed: pbs, slurm, local")


def detect() -> str | None:
    """Which scheduler this login node has: SLURM first (a qstat may be SLURM's wrapper)."""
    if shutil.which("squeue"):
        return "slurm"
    if shutil.which("qstat"):
        return "pbs"
    return None
