"""This machine: run the script now, stream its output, keep its exit code."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import UserError
from hpc.schedulers import JobState, Scheduler, Submission

if TYPE_CHECKING:
    from hpc.job import Job


class Local(Scheduler):
    """Runs the rendered script with bash in the current directory, to the end."""

    name = "local"
    script_suffix = ".sh"
    launchers = ("torchrun",)
    runs_here = True
    # submit writes output.log, then output-2.log ... for each --resume (create_free)
    log_patterns = (r"output(?:-(?P<seq>[0-9]+))?\.log",)
    id_examples = "local-PID-START"

    def launch(self, job: Job) -> tuple[list[str], list[str]]:
        """The command itself for one rank, else ``torchrun --standalone``."""
        from hpc import launchers

        return [], launchers.local(job)

    def owns_id(self, job_id: str) -> bool:
        """``local-PID-START`` (older runs: ``local-PID``)."""
        try:
            _parse(job_id)
        except UserError:
            return False
        return True

    def log_name(self, job_name: str, job_id: str, task: str | None, seq: int) -> str | None:
        """``output.log`` for a run's first job, ``output-N.log`` for its Nth (no id in the name)."""
        return "output.log" if seq == 1 else f"output-{seq}.log"

    def submit_command(self, script: str) -> list[str]:
        """``bash SCRIPT``."""
        return ["bash", script]

    def parse_job_id(self, stdout: str) -> str:
        """Local ids are ``local-PID``."""
        return stdout.strip()

    def submit(
        self, script: str, run_dir: str, on_start: Callable[[str], None] | None = None
    ) -> Submission:
        """Run to the end, streaming output to the terminal and a new ``output*.log``.

        ``on_start`` gets the job id as soon as the process exists, so ``hpc status``
        and ``hpc cancel`` work while it runs. The id is ``local-PID-START``: START is
        the process's start time (clock ticks since boot, /proc/PID/stat), so a later
        cancel can tell the run from an unrelated process that reused the pid.
        """
        from hpc.runs import create_free

        log = create_free(Path(run_dir), "output", ".log")  # a resumed run keeps older logs
        with log.open("wb") as sink:
            # Its own session: `hpc cancel` signals the whole job (srun-like), not only bash.
            proc = subprocess.Popen(
                self.submit_command(script), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            job_id = f"local-{proc.pid}-{_start_ticks(proc.pid)}"
            if on_start is not None:
                on_start(job_id)
            assert proc.stdout is not None
            out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
            old = _forward_signals(proc.pid)  # Ctrl-C and kills reach the job's session
            try:
                for chunk in iter(lambda: proc.stdout.read1(65536), b""):  # type: ignore[union-attr]
                    sink.write(chunk)
                    sink.flush()  # `hpc logs -f` reads the log while the job runs
                    if out is not None:
                        out.write(chunk)
                        out.flush()
                    else:
                        sys.stdout.write(chunk.decode(errors="replace"))
                rc = proc.wait()
            finally:
                for signum, handler in old.items():
                    signal.signal(signum, handler)
        # killed by signal N: 128+N, as a shell says
        return Submission(job_id, exit_code=128 - rc if rc < 0 else rc)

    def status(self, job_id: str) -> JobState:
        """RUNNING while the very process of the job lives; a finished one from its run dir."""
        return JobState.RUNNING if _alive(*_parse(job_id)) else JobState.UNKNOWN

    def cancel(self, job_id: str) -> None:
        """SIGTERM to the job's process, only if that pid is still the job's process."""
        pid, start = _parse(job_id)
        if not _alive(pid, start):
            raise UserError(f"job: {job_id!r} is not running (finished, or its pid now belongs "
                            "to another process); allowed: a running local job")  # fmt: skip
        os.killpg(pid, signal.SIGTERM)  # the job's session leader: every process of the job


def _forward_signals(pgid: int) -> dict[int, Any]:
    """Pass SIGINT, SIGTERM and SIGHUP on to the job's process group while it runs.

    The job has its own session (so ``hpc cancel`` can signal all of it), which also
    means a terminal's Ctrl-C no longer reaches it directly. Forwarding keeps the job's
    own reaction (the trainer checkpoints on SIGTERM) and ``hpc run`` waits for it."""

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)

    old: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # not the main thread: nothing to forward
            old[signum] = signal.signal(signum, forward)
    return old


def _parse(job_id: str) -> tuple[int, int | None]:
    """(pid, start ticks) of ``local-PID-START``; older ``local-PID`` ids have no start."""
    parts = job_id.removeprefix("local-").split("-")
    # [0-9] only: str.isdigit takes any script's digits (١٢٣), and int() reads them.
    if not job_id.startswith("local-") or len(parts) > 2 or not all(
        re.fullmatch("[0-9]{1,20}", p) for p in parts
    ):
        raise UserError(f"job: {job_id!r} is not a local job id; allowed: local-PID-START")
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else None


def _start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat (after the command name, which may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return 0
    return int(stat[stat.rfind(")") + 2 :].split()[19])


def _alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # Without a recorded start time the pid alone proves nothing: treat as gone. The
    # job was started as a session leader, which an unrelated process reusing the pid
    # (within the same 10 ms start-time tick) almost never is.
    try:
        leader = os.getsid(pid) == pid
    except OSError:
        return False
    return start is not None and leader and _start_ticks(pid) == start


SCHEDULER = Local
