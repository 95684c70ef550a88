"""SLURM: sbatch --parsable; squeue, then sacct (or its jobcomp log), then scontrol; scancel."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import UserError
from hpc.schedulers import JobState, Scheduler, SchedulerError, last_line, run

if TYPE_CHECKING:
    from hpc.cluster import Cluster
    from hpc.job import Job
    from hpc.spec import JobSpec

# [0-9], not \d: \d and str.isdigit take any script's digits (١٢٣, １２３), which no
# scheduler gives and int() would quietly read as 123.
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?\Z")
_MAP = {
    "PENDING": "PENDING", "REQUEUED": "PENDING", "REQUEUE_HOLD": "PENDING",
    "REQUEUE_FED": "PENDING", "RESV_DEL_HOLD": "PENDING", "SUSPENDED": "PENDING",
    "CONFIGURING": "RUNNING", "RUNNING": "RUNNING", "COMPLETING": "RUNNING",
    "RESIZING": "RUNNING", "SIGNALING": "RUNNING", "STAGE_OUT": "RUNNING", "STOPPED": "RUNNING",
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED", "NODE_FAIL": "FAILED", "BOOT_FAIL": "FAILED",
    "OUT_OF_MEMORY": "FAILED", "DEADLINE": "FAILED", "SPECIAL_EXIT": "FAILED",
    "CANCELLED": "CANCELLED", "REVOKED": "CANCELLED",
    "TIMEOUT": "TIMEOUT", "PREEMPTED": "PREEMPTED",
}


def normalize(state: str) -> JobState:
    """SLURM state words (``CANCELLED by 0``, ``CD``-free long form) -> a normalized state."""
    word = state.strip().split()[0].rstrip("+").upper() if state.strip() else ""
    return JobState(_MAP.get(word, "UNKNOWN"))


def _first(text: str) -> str | None:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return None


class Slurm(Scheduler):
    """SLURM: sbatch scripts, ranks started by srun (or one torchrun per node)."""

    name = "slurm"
    script_suffix = ".slurm"
    launchers = ("srun", "torchrun")
    queue_directives = ("partition", "qos", "queue")
    client = "squeue"
    detect_order = 10
    array_index_var = "SLURM_ARRAY_TASK_ID"
    array_throttle = True  # --array=0-9%2
    # --output=DIR/%x-%j.out (an array's tasks: %x-%A_%a.out), from template_values
    log_patterns = (r"(?P<name>.+)-(?P<job>[0-9]+(?:_[0-9]+)?)\.out",)
    id_examples = "12345, 12345_3"

    def check_spec(self, spec: JobSpec, cluster: Cluster) -> None:
        """``filesystems`` is a PBS resource."""
        if spec.filesystems is not None:
            raise UserError(f"filesystems: {spec.filesystems!r} is a PBS resource; {cluster.name} is "
                            "slurm; allowed: leave it out")

    def check_runs_dir(self, path: Path) -> None:
        """sbatch expands ``%`` in ``--output`` as a file-name pattern."""
        if "%" in str(path.resolve()):
            raise UserError(f"--runs-dir: {str(path)!r} holds '%', which sbatch's --output "
                            "expands as a file-name pattern; allowed: a path without %")

    def job_env(self, job: Job) -> dict[str, str]:
        """``--requeue`` alone never requeues a job that exits after its preemption signal:
        DDP_REQUEUE tells the trainer to ``scontrol requeue`` itself once its checkpoint is saved."""
        return {"DDP_REQUEUE": "1"} if job.spec.requeue else {}

    def template_values(self, job: Job) -> dict[str, Any]:
        """Tasks and CPUs per task as sbatch must see them: one torchrun task per node holds
        all of that node's ranks and their CPUs."""
        per_node = job.launcher == "torchrun"
        cpus = job.cpus_per_task
        return {
            "tasks_per_node": 1 if per_node else job.ppn,
            "cpus_per_task": cpus * job.ppn if cpus and per_node else cpus,
            "array": self.array_spec(job),
            # An array task's %j is its own id: name its log by the array's id and index.
            "log_name": "%x-%A_%a.out" if job.array_size else "%x-%j.out",
        }

    def split_id(self, job_id: str) -> tuple[str, str | None] | None:
        """``12345`` -> (12345, None); an array task ``12345_3`` -> (12345, 3)."""
        if not _JOB_ID.match(job_id):
            return None
        number, _, task = job_id.partition("_")
        return number, task or None

    def log_name(self, job_name: str, job_id: str, task: str | None, seq: int) -> str | None:
        """``NAME-ID.out``, an array task's ``NAME-ARRAYID_TASK.out`` (see ``log_name`` above)."""
        key = self.split_id(job_id)
        if key is None:
            return None
        return f"{job_name}-{key[0]}.out" if task is None else f"{job_name}-{key[0]}_{task}.out"

    def launch(self, job: Job) -> tuple[list[str], list[str]]:
        """``srun`` per rank, or one ``torchrun`` per node through srun."""
        from hpc import launchers

        if job.launcher == "torchrun":
            return launchers.torchrun_per_node(job)
        return [], launchers.srun(job)

    def submit_command(self, script: str) -> list[str]:
        """``sbatch --parsable SCRIPT``: the id alone on stdout."""
        return ["sbatch", "--parsable", script]

    def parse_job_id(self, stdout: str) -> str:
        """``123`` or ``123;cluster`` (--parsable), or ``Submitted batch job 123``."""
        for line in stdout.splitlines():
            word = line.strip().split(";")[0]
            if _JOB_ID.match(word):
                return word
            match = re.search(r"Submitted batch job ([0-9]+)", line)
            if match:
                return match.group(1)
        raise SchedulerError(f"sbatch: no job id in its answer: {last_line(stdout)!r}")

    def status(self, job_id: str) -> JobState:
        """squeue while queued or running; then scontrol, then sacct (no accounting needed).

        ``scontrol show job`` knows a finished job for MinJobAge seconds and always its
        latest run. sacct comes last: without accounting storage it says "accounting
        storage is disabled", but with a jobcomp log ``sacct -c`` still answers; a
        requeued job has one record a run there, so the last line is the current one.
        """
        proc = run(["squeue", "-h", "-j", job_id, "-o", "%T"])
        if proc.returncode == 0 and _first(proc.stdout):
            return normalize(_first(proc.stdout) or "")
        proc = run(["scontrol", "show", "job", job_id])
        match = re.search(r"JobState=(\S+)", proc.stdout) if proc.returncode == 0 else None
        if match and normalize(match.group(1)) != "UNKNOWN":
            return normalize(match.group(1))
        for argv in (
            ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"],
            ["sacct", "-c", "-n", "-P", "-j", job_id, "-o", "State"],
        ):
            proc = run(argv)
            lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
            disabled = "accounting storage is disabled" in (proc.stdout + proc.stderr).lower()
            if proc.returncode == 0 and lines and not disabled:
                state = normalize(lines[-1])
                if state != "UNKNOWN":
                    return state
        return JobState.UNKNOWN

    def exit_code(self, job_id: str) -> int | None:
        """``ExitCode=CODE:SIGNAL`` from scontrol, else sacct (``-c``: the jobcomp log)
        once the controller forgot the job. An array's is its worst task's (scontrol
        shows a record per task)."""
        proc = run(["scontrol", "show", "job", job_id])
        shown = proc.stdout if proc.returncode == 0 else ""
        pairs = re.findall(r"(?<![A-Za-z])ExitCode=([0-9]+):([0-9]+)", shown)  # not Derived...
        for argv in (
            ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "ExitCode"],
            ["sacct", "-c", "-n", "-P", "-j", job_id, "-o", "ExitCode"],
        ):
            if pairs:
                break
            proc = run(argv)
            lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
            last = re.fullmatch(r"([0-9]+):([0-9]+)", lines[-1]) if lines else None
            if proc.returncode == 0 and last:  # a requeued job: its last run is the last line
                pairs = [last.groups()]
        codes = [128 + int(sig) if int(sig) else int(code) for code, sig in pairs]
        return max(codes) if codes else None

    def cancel(self, job_id: str) -> None:
        """``scancel -v ID``; a refusal is a SchedulerError with scancel's own line.

        Without ``-v``, scancel (22.05, the test cluster's) exits 0 and prints nothing for
        an id it does not know or a job that has already ended; ``-v`` makes it say
        ``error: Kill job error on job id N: Invalid job id specified`` (or ``... already
        completing or completed``), still with exit 0, so the error lines decide.
        """
        proc = run(["scancel", "-v", job_id])
        errors = [ln for ln in (proc.stderr or "").splitlines() if "error" in ln.lower()]
        if proc.returncode != 0 or errors:
            said = "\n".join(errors) or proc.stderr or proc.stdout
            raise SchedulerError(f"scancel {job_id} refused (exit {proc.returncode}): "
                                 f"{last_line(said)}")

SCHEDULER = Slurm
