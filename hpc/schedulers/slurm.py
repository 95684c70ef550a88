"""SLURM: sbatch --parsable; squeue -j A,B,C (batched), then scontrol, then sacct (or its
jobcomp log); scancel."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import UserError
from hpc.schedulers import JobState, Scheduler, SchedulerError, chunks, last_line, run
from hpc.schedulers._slurm_answers import (
    _JOB_ID,
    DEFAULT_MAX_ARRAY_SIZE,
    _asked,
    _sacct_lines,
    _scontrol_records,
    _settle,
    _squeue_lines,
    normalize,
    parse_array_limit,
)

if TYPE_CHECKING:
    from hpc.chain import After
    from hpc.cluster import Cluster
    from hpc.job import Job
    from hpc.spec import JobSpec
    from hpc.stage import Stage

__all__ = [
    "DEFAULT_MAX_ARRAY_SIZE",
    "SCHEDULER",
    "SCONTROL_ONE_BY_ONE",
    "Slurm",
    "normalize",
    "parse_array_limit",
    "slurm_time",
]

#: Most job numbers asked of scontrol one call each (it takes one id); past this one
#: call lists every job the controller holds.
SCONTROL_ONE_BY_ONE = 4


def slurm_time(seconds: int) -> str:
    """``--time`` as sbatch takes it: HH:MM:SS below a day, D-HH:MM:SS from one day on."""
    from hpc._util import format_walltime

    days, rest = divmod(seconds, 86400)
    return f"{days}-{format_walltime(rest)}" if days else format_walltime(rest)


class Slurm(Scheduler):
    """SLURM: sbatch scripts, ranks started by srun (or one torchrun per node)."""

    name = "slurm"
    script_suffix = ".slurm"
    default_launcher = "srun"  # or one torchrun per node (hpc.schedulers.LAUNCHERS)
    supervised_launchers = ("srun",)  # --nodelist/--exclude per relaunch
    queue_directives = ("partition", "qos", "queue")
    client = "squeue"
    detect_order = 10
    array_index_var = "SLURM_ARRAY_TASK_ID"
    array_throttle = True  # --array=0-9%2
    array_parts = True  # sbatch --array=0-N SCRIPT OFFSET (array_part_command)
    array_size_setting = "MaxArraySize"
    # --output=DIR/%x-%j.out (an array's tasks: %x-%A_%a.out), from template_values
    log_patterns = (r"(?P<name>.+)-(?P<job>[0-9]+(?:_[0-9]+)?)\.out",)
    id_examples = "12345, 12345_3"
    job_id_var = "SLURM_JOB_ID"

    def check_spec(self, spec: JobSpec, cluster: Cluster) -> None:
        """``filesystems`` is a PBS resource."""
        if spec.filesystems is not None:
            raise UserError(
                f"filesystems: {spec.filesystems!r} is a PBS resource; {cluster.name} is "
                "slurm; allowed: leave it out"
            )

    def check_runs_dir(self, path: Path) -> None:
        """sbatch expands ``%`` in ``--output`` as a file-name pattern."""
        if "%" in str(path.resolve()):
            raise UserError(
                f"--runs-dir: {str(path)!r} holds '%', which sbatch's --output "
                "expands as a file-name pattern; allowed: a path without %"
            )

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
            "slurm_time": slurm_time(job.walltime),
            "tasks_per_node": 1 if per_node else job.ppn,
            "cpus_per_task": cpus * job.ppn if cpus and per_node else cpus,
            "array": self.array_spec(job),
            # An array task's %j is its own id: name its log by the array's id and index.
            "log_name": "%x-%A_%a.out" if job.array_size else "%x-%j.out",
            "err_name": "%x-%A_%a.err" if job.array_size else "%x-%j.err",
        }

    def array_size_limit(self) -> int:
        """``MaxArraySize`` from ``scontrol show config`` (and ``max_array_tasks`` of
        ``SchedulerParameters`` where it is lower), read at submit time.

        slurm.conf(5), MaxArraySize: "The maximum job array task index value will be one
        less than MaxArraySize to allow for an index value of zero ... The default value
        is 1001" (https://slurm.schedmd.com/slurm.conf.html#OPT_MaxArraySize; also
        https://slurm.schedmd.com/job_array.html: "the maximum value is ... MaxArraySize
        minus one"). It caps the index, not the count, so a part holds at most that many
        tasks numbered from 0. Unreadable (no scontrol, no controller): the default.
        ``MaxArraySize=0`` disables arrays: one line.
        """
        try:
            proc = run(["scontrol", "show", "config"], timeout=30)
        except SchedulerError:
            return DEFAULT_MAX_ARRAY_SIZE
        return parse_array_limit(proc.stdout if proc.returncode == 0 else "")

    def array_part_command(
        self,
        script: str,
        count: int,
        offset: int,
        max_parallel: int | None = None,
        after: After | None = None,
    ) -> list[str]:
        """``sbatch --parsable --array=0-(count-1)[%P] SCRIPT OFFSET``: the command line's
        ``--array`` wins over the script's ``#SBATCH --array`` (sbatch(1): options on the
        command line override those in the script), and the offset reaches the task as
        the script's first argument (sbatch(1): "script [args(0)...]")."""
        spec = f"0-{count - 1}" + (f"%{max_parallel}" if max_parallel else "")
        return [
            "sbatch",
            "--parsable",
            f"--array={spec}",
            *(self.dependency(after) if after else []),
            script,
            str(offset),
        ]

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

    def err_log_name(self, out_name: str) -> str | None:
        """``NAME-ID.err`` beside ``NAME-ID.out`` (``split_logs``: ``--error=%x-%j.err``)."""
        return out_name[: -len(".out")] + ".err" if out_name.endswith(".out") else None

    def stage_lines(self, job: Job, stage: Stage) -> list[str]:
        """``sbcast`` the pack to every node's local storage (SLURM's own broadcast over
        its daemons' tree, so the shared file system serves one read: sbcast(1),
        https://slurm.schedmd.com/sbcast.html), unpack with one task per node, then drop
        each node's copy of the tar (a separate step: two emulated nodes share one /tmp)."""
        per_node = (
            'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" '
            "--ntasks-per-node=1 --kill-on-bad-exit=1"
        )
        # under resilience one node's failure must not end the others' unpack (their marks)
        unpack = per_node.replace(" --kill-on-bad-exit=1", "") if stage.tolerant else per_node
        return stage.lines(
            self.job_id_var or "",
            spread=['sbcast --force "$HPC_STAGE_TAR" "$HPC_STAGE_DEST.tar"'],
            unpack=[
                f'{unpack} bash -c "$HPC_STAGE_UNPACK" unpack "$HPC_STAGE_DEST.tar" '
                f'"$HPC_STAGE_DEST" {shlex.quote(stage.venv)}{stage.ok_arg}'
            ],
            cleanup=[f'{per_node} rm -f "$HPC_STAGE_DEST.tar"'],
        )

    def submit_command(self, script: str, after: After | None = None) -> list[str]:
        """``sbatch --parsable SCRIPT``: the id alone on stdout."""
        return ["sbatch", "--parsable", *(self.dependency(after) if after else []), script]

    def dependency(self, after: After) -> list[str]:
        """``--dependency=afterok:ID`` (sbatch(1), --dependency, "afterok:job_id[:jobid...]":
        https://slurm.schedmd.com/sbatch.html#OPT_dependency). An array's id stands for all
        its tasks and ``123_4`` for that task alone, as SLURM's job-array page says
        (https://slurm.schedmd.com/job_array.html, "Job Dependencies"); unverified here:
        that page could not be read from this machine, and the SLURM 22.05 man page here
        does not say it."""
        return [f"--dependency=after{after.kind}:{after.job_id}"]

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
        """The state :meth:`statuses` finds for one id."""
        return self.statuses([job_id])[job_id]

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        """Every id's state in as few calls as the answers allow, each one batched.

        1. ``squeue -h -r -t all -j A,B,C -o %i|%A|%T``: queued, running and recently
           ended jobs (``-t all``: those the controller still holds, MinJobAge seconds
           after the end; ``-r``: an array's tasks one a line). An array's id answers
           for all its tasks, so a task whose array is asked too is not named again:
           a 1,000-task sweep is one call. Ids the controller does not know are left
           out of the answer (a list of two or more; one unknown id alone is an error).
        2. For ids still unanswered (the client failed, or refused one id),
           ``scontrol -o show job NUMBER`` once per job number (an array's number
           shows every task); for more than :data:`SCONTROL_ONE_BY_ONE` numbers one
           ``scontrol -o show job`` of every job the controller holds.
        3. ``sacct -X -n -P -j A,B,C -o JobID,State``, then ``sacct -c`` (the jobcomp
           log, answering without accounting storage): a requeued job has a line a
           run, so the last line of an id is its current state.
        """
        ids = list(dict.fromkeys(job_ids))
        found: dict[str, JobState] = {}
        for group in chunks(_asked(ids), sep=1):
            proc = run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(group), "-o", "%i|%A|%T"])
            if proc.returncode == 0:
                _settle(found, ids, _squeue_lines(proc.stdout), first=True)
        left = [j for j in ids if j not in found]
        numbers = list(dict.fromkeys(j.partition("_")[0] for j in left))
        # scontrol takes one id: a few jobs one call each, more all of them in one call
        for number in numbers if len(numbers) <= SCONTROL_ONE_BY_ONE else [None]:
            proc = run(["scontrol", "-o", "show", "job", *([number] if number else [])])
            if proc.returncode == 0:
                _settle(found, left, _scontrol_records(proc.stdout), first=True)
        for flag in ("-X", "-c"):
            left = [j for j in ids if j not in found]
            for group in chunks(left, sep=1):
                proc = run(["sacct", flag, "-n", "-P", "-j", ",".join(group), "-o", "JobID,State"])
                disabled = "accounting storage is disabled" in (proc.stdout + proc.stderr).lower()
                if proc.returncode == 0 and not disabled:
                    _settle(found, group, _sacct_lines(proc.stdout), first=False)
        return {j: found.get(j, JobState.UNKNOWN) for j in ids}

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
            raise SchedulerError(
                f"scancel {job_id} refused (exit {proc.returncode}): {last_line(said)}"
            )

    # --- the Python API (hpc.executor): issue 29 ----------------------------------------

    def submitit_executor(
        self, job: Job, folder: Path, max_num_timeout: int = 3, run_dir: Path | None = None
    ) -> Any:
        """submitit's SlurmExecutor (one srun task per rank), parameters from ``job``."""
        from hpc.executors import params
        from hpc.executors.recorded import SlurmExecutor

        self.check_submitit_launcher(job, " (submitit starts one srun task per rank)")
        try:
            ex = SlurmExecutor(
                folder,
                max_num_timeout=max_num_timeout,
                python="python" if job.spec.python else None,
                run_dir=run_dir,
                scheduler=self,
            )
        except RuntimeError:
            raise UserError(
                f"cluster: {job.cluster.name} is a SLURM cluster but srun is not on "
                "PATH here; allowed: a login node of that cluster, or cluster='local' "
                "/ 'debug' on this machine"
            ) from None
        ex.update_parameters(**params.slurm_parameters(job))
        return ex

    usage_client = "sacct"

    def job_usage(self, job_id: str) -> tuple[float, int] | str:
        """sacct's Start, End and NNodes (the reader lives with the charge arithmetic)."""
        from hpc.charges import _slurm_used

        return _slurm_used(job_id)


SCHEDULER = Slurm
