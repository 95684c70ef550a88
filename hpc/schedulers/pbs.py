"""PBS Pro: qsub, qstat (JSON with a text fallback), qdel."""

from __future__ import annotations

import json
import re
from typing import Any

from hpc.schedulers import SchedulerError, last_line, run

_JOB_ID = re.compile(r"^\d+(\[\d*\])?(\.[A-Za-z0-9_.-]+)?\Z")
# job_state letters (PBS Pro reference guide); F/X are looked at with Exit_status.
_STATES = {
    "Q": "PENDING", "H": "PENDING", "W": "PENDING", "T": "PENDING", "M": "PENDING",
    "S": "PENDING", "U": "PENDING",
    "R": "RUNNING", "E": "RUNNING", "B": "RUNNING",
}
# Exit_status values PBS sets itself (negative JOB_EXEC_* codes, 256+signal for kills).
_WALLTIME_KILLED = {-29}  # JOB_EXEC_KILL_WALLTIME
_CANCEL_CODES = {271, 265}  # SIGTERM / SIGKILL from qdel (only read when there is no substate)
# Substates of finished jobs (job.h JOB_SUBSTATE_*): 91 terminated, 92 finished, 93 failed.
_TERMINATED, _FINISHED, _FAILED = "91", "92", "93"


def normalize(state: str, exit_status: int | None = None, substate: str | None = None) -> str:
    """PBS job_state letter (+ substate, then Exit_status, once finished) -> a normalized state.

    The substate decides first because the real server's Exit_status cannot tell a
    ``qdel`` apart: a running job deleted by ``qdel`` ends with substate 91 and
    Exit_status 271 (256+SIGTERM) *or* 0 or the script's own code (143 from a shell
    that traps TERM), depending on how fast the script dies (seen on OpenPBS 23.06,
    tests/hpc/data/openpbs/*deleted*.json). Within substate 93 (failed) Exit_status -29
    still says the walltime killed it. Without a substate (``qstat -f`` of servers that
    hide it, Torque) Exit_status alone decides, as before.
    """
    state = state.strip().upper()[:1]
    if state in _STATES:
        return _STATES[state]
    if state not in ("F", "X"):
        return "UNKNOWN"
    sub = str(substate if substate is not None else "").strip()
    if sub == _TERMINATED:
        return "CANCELLED"
    if sub == _FINISHED:
        return "COMPLETED"
    if sub == _FAILED:
        return "TIMEOUT" if exit_status in _WALLTIME_KILLED else "FAILED"
    if exit_status is None:
        return "COMPLETED" if state == "X" else "UNKNOWN"
    if exit_status == 0:
        return "COMPLETED"
    if exit_status in _WALLTIME_KILLED:
        return "TIMEOUT"
    if exit_status in _CANCEL_CODES:
        return "CANCELLED"
    return "FAILED"


def parse_qstat_json(text: str, job_id: str) -> str:
    """State from ``qstat -x -f -F json``."""
    data = json.loads(text)
    jobs = data.get("Jobs") or {}
    info = jobs.get(job_id)
    if info is None:  # the server may add its name: 123 -> 123.server
        info = next((v for k, v in jobs.items() if k.split(".")[0] == job_id.split(".")[0]), None)
    if info is None:
        return "UNKNOWN"
    exit_status = info.get("Exit_status")
    return normalize(str(info.get("job_state", "")),
                     None if exit_status in (None, "") else int(exit_status),
                     info.get("substate"))  # fmt: skip


def parse_qstat_text(text: str) -> str:
    """State from ``qstat -f`` (``job_state = R``, ``Exit_status = 0``)."""
    state = re.search(r"^\s*job_state\s*=\s*(\S+)", text, re.M)
    code = re.search(r"^\s*Exit_status\s*=\s*(-?\d+)", text, re.M)
    sub = re.search(r"^\s*substate\s*=\s*(\d+)", text, re.M)
    if not state:
        return "UNKNOWN"
    return normalize(state.group(1), int(code.group(1)) if code else None,
                     sub.group(1) if sub else None)  # fmt: skip


class PBS:
    """PBS Pro through its command-line clients."""

    name = "pbs"

    def submit_command(self, script: str) -> list[str]:
        """``qsub SCRIPT``: every setting is in the script's directives."""
        return ["qsub", script]

    def parse_job_id(self, stdout: str) -> str:
        """qsub prints the id alone: ``123.server`` (or ``123``)."""
        for line in stdout.splitlines():
            if _JOB_ID.match(line.strip()):
                return line.strip()
        raise SchedulerError(f"qsub: no job id in its answer: {last_line(stdout)!r}")

    def submit(self, script: str, run_dir: str, on_start: Any = None) -> str:
        """Submit and return the job id (``on_start`` is for local runs, which block)."""
        proc = run(self.submit_command(script))
        if proc.returncode != 0:
            raise SchedulerError(f"qsub refused the job (exit {proc.returncode}): {last_line(proc.stderr or proc.stdout)}")
        return self.parse_job_id(proc.stdout)

    def status(self, job_id: str) -> str:
        """``qstat -x -f -F json``, else ``qstat -f`` (older servers, wrappers)."""
        proc = run(["qstat", "-x", "-f", "-F", "json", job_id])
        if proc.returncode == 0:
            try:
                return parse_qstat_json(proc.stdout, job_id)
            except (ValueError, AttributeError, TypeError):
                pass
        proc = run(["qstat", "-f", job_id])
        if proc.returncode == 0:
            return parse_qstat_text(proc.stdout)
        return "UNKNOWN"

    def cancel(self, job_id: str) -> None:
        """``qdel ID``."""
        proc = run(["qdel", job_id])
        if proc.returncode != 0:
            raise SchedulerError(f"qdel {job_id} failed (exit {proc.returncode}): {last_line(proc.stderr or proc.stdout)}")
