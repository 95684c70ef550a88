"""A submitit executor for any scheduler of ``hpc.schedulers``: its own script and clients.

``hpc.executor(cluster=...)`` asks the cluster's scheduler for its submitit executor
(:meth:`hpc.schedulers.Scheduler.submitit_executor`). SLURM and this machine answer
with submitit's own executors; every other scheduler gets :class:`ScriptExecutor`
unless its module says otherwise, so a new scheduler (one module, a template and a
profile) has the Python API without a line of submitit code:

- the job script is the scheduler's own template, rendered from the resolved, frozen
  ``hpc.job.Job`` the executor holds (the command: ``python -u -m ENTRY FOLDER``);
- submit, status and cancel are the scheduler's own (``submit``, ``statuses``,
  ``cancel``), so a refusal is the same one-line ``SchedulerError`` as ``hpc submit``'s;
- on the compute node, :func:`main` runs the pickled call as the rank torchrun's
  variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) name: a launcher that starts
  every rank itself runs the entry under ``ddp.exec``, which exports them (the job's
  ``wrapped``, as for any command); the job's id comes from the scheduler's
  ``job_id_var``, exported as ``HPC_SUBMITIT_JOB_ID`` by the script.

:class:`hpc.executors.pbs.PBSExecutor` is this executor with PBS's additions (its ranks
read PALS/MPICH variables, its jobs follow requeues, preemption by a timer).
The job it returns, :class:`~hpc.executors.script_job.ScriptJob`, is in
``hpc.executors.script_job`` (re-exported here).

Like ``hpc.executors.pbs``, this module imports submitit at module level (its classes
derive from submitit's); only the schedulers' ``submitit_executor`` import it.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import typing as tp
import uuid
from dataclasses import replace
from pathlib import Path

from submitit.core import core, job_environment, utils

from hpc.errors import UserError
from hpc.executors.recorded import Recorded
from hpc.executors.script_job import ScriptJob, StatesWatcher, watcher_of

if tp.TYPE_CHECKING:
    from hpc.job import Job
    from hpc.schedulers import Scheduler

__all__ = [
    "JOB_ID_VAR",
    "SPEC_PARAMETERS",
    "ScriptExecutor",
    "ScriptJob",
    "ScriptJobEnvironment",
    "StatesWatcher",
    "main",
    "run_rank",
    "spec_parameters",
    "watcher_of",
]

#: JobSpec keys the executor takes as parameters (the command and logs are its own).
SPEC_PARAMETERS = (
    "name",
    "nodes",
    "ppn",
    "walltime",
    "queue",
    "account",
    "env",
    "modules",
    "setup",
    "python",
    "signal",
    "requeue",
    "directives",
    "launcher",
    "gpus_per_node",
    "cpus_per_task",
    "filesystems",
)
#: The job's id inside the job, as the script exports it from the scheduler's variable.
JOB_ID_VAR = "HPC_SUBMITIT_JOB_ID"


def spec_parameters(job: Job) -> dict[str, tp.Any]:
    """A resolved job as executor parameters (what ``update_parameters`` merges into)."""
    data = job.to_dict()
    params = {k: data[k] for k in SPEC_PARAMETERS if k in data}
    params["walltime"] = job.walltime
    params["cluster"] = job.cluster.name
    return params


# --- the executor -------------------------------------------------------------------


class ScriptExecutor(Recorded, core.PicklingExecutor):
    """Pickles calls and submits the scheduler's own script for them.

    Holds the resolved ``Job`` (frozen): given one (``hpc.executor``), it is used as it
    is, with the executor's command and folder put in; parameters set later
    (``update_parameters``: the job spec's keys, or submitit's generic names
    ``timeout_min``, ``tasks_per_node``) resolve a new one, checked exactly as
    ``hpc render`` checks a job. ``map_array`` of N calls is the job as the
    scheduler's array of N (``Scheduler.submitit_array``), else N jobs.
    """

    #: submitit's attribute (an instance variable there); PBSExecutor's is PBSJob.
    job_class: type[core.Job[tp.Any]] = ScriptJob
    #: ``python -m ENTRY FOLDER`` runs one rank on the compute node.
    entry: tp.ClassVar[str] = "hpc.executors.script"

    def __init__(
        self,
        folder: str | Path,
        max_num_timeout: int = 3,
        max_pickle_size_gb: float = 1.0,
        python: str | None = None,
        cluster: str | None = None,
        *,
        job: Job | None = None,
        run_dir: Path | None = None,
    ) -> None:
        from hpc.spec import path_value

        path_value(str(folder), "folder")  # it becomes the script's log folder
        super().__init__(
            folder,
            max_num_timeout=max_num_timeout,
            max_pickle_size_gb=max_pickle_size_gb,
            run_dir=run_dir,
        )
        self.python = python if python is not None else shlex.quote(sys.executable)
        self.job: Job | None = None
        if job is None:
            self.parameters: dict[str, tp.Any] = {"cluster": cluster or self.default_cluster()}
        else:
            self.parameters = spec_parameters(job)
            self.job = self._for_submitit(job)

    @classmethod
    def default_cluster(cls) -> str:
        """The profile used when neither a job nor a cluster is given."""
        raise UserError("cluster: missing; allowed: a profile name (hpc clusters)")

    @classmethod
    def environment_name(cls) -> str:
        """``SUBMITIT_EXECUTOR`` in the job: which job environment its ranks run under."""
        return ScriptJobEnvironment.name()

    @classmethod
    def _equivalence_dict(cls) -> core.EquivalenceDict:
        return {
            "name": "name",
            "timeout_min": "timeout_min",
            "mem_gb": "mem_gb",
            "nodes": "nodes",
            "cpus_per_task": "cpus_per_task",
            "gpus_per_node": "gpus_per_node",
            "tasks_per_node": "ppn",
        }

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return {*SPEC_PARAMETERS, "cluster", "timeout_min", "signal_delay_s", "tasks_per_node"}

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of the job's cluster."""
        return self.resolve().scheduler

    def _recording_scheduler(self) -> Scheduler | None:
        return self.scheduler

    # --- the job ------------------------------------------------------------------

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        """Check the new parameters by resolving the job (same checks as ``hpc render``)."""
        from hpc._util import check_keys

        check_keys(kwargs, sorted(self._valid_parameters()), f"{type(self).__name__} parameters")
        if "mem_gb" in kwargs:
            raise UserError(
                "mem_gb: memory requests are not in the job template; "
                "allowed: leave it out (nodes are allocated whole)"
            )
        if "tasks_per_node" in kwargs:
            kwargs["ppn"] = kwargs.pop("tasks_per_node")
        if "timeout_min" in kwargs:
            kwargs["walltime"] = max(60, int(round(float(kwargs.pop("timeout_min")) * 60)))
        merged = {**self.parameters, **kwargs}
        self.job = self._resolve(merged)
        self.parameters = merged

    def resolve(self, parameters: dict[str, tp.Any] | None = None) -> Job:
        """The ``hpc.job.Job`` this executor submits (``parameters``: those, not its own)."""
        if parameters is not None:
            return self._resolve(parameters)
        if self.job is None:
            self.job = self._resolve(self.parameters)
        return self.job

    def _resolve(self, parameters: dict[str, tp.Any]) -> Job:
        from hpc.core import build_job

        params = {k: v for k, v in parameters.items() if k != "signal_delay_s"}
        if params.get("name") is None:
            params["name"] = "submitit"
        params.update(command=self._command(), output_dir=str(self.folder), wrap="never")
        return self._for_submitit(build_job(None, params))

    def _for_submitit(self, job: Job) -> Job:
        """``job`` running this executor's entry, logging into its folder."""
        from hpc.schedulers import LAUNCHERS

        env = {**job.spec.env, "SUBMITIT_EXECUTOR": self.environment_name()}
        job = job.with_spec(
            command=self._command(), output_dir=str(self.folder), env=env, wrap="never"
        )
        return self._submitit_lines(replace(job, wrapped=LAUNCHERS[job.launcher].per_rank))

    def _submitit_lines(self, job: Job) -> Job:
        """The job id as the entry reads it (the scheduler's variable for its job's id)."""
        var = job.scheduler.job_id_var
        if var is None:
            raise UserError(
                f"cluster: the {job.scheduler.name} scheduler names no variable "
                "for a job's id, which submitit needs; allowed: a scheduler with "
                "job_id_var"
            )
        line = f'export {JOB_ID_VAR}="${{{var}}}"'
        return job.with_spec(setup=[*job.spec.setup, line])

    def _command(self) -> list[str]:
        return [*shlex.split(self.python), "-u", "-m", self.entry, str(self.folder)]

    @property
    def _submitit_command_str(self) -> str:
        return shlex.join(self._command())

    def _num_tasks(self) -> int:
        return int(self.resolve().ranks)

    # --- submitting ---------------------------------------------------------------

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        from hpc.core import render_job

        return render_job(self.resolve())

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return self.scheduler.submit_command(str(submission_file_path))

    def _get_job_id_from_submission_command(self, string: bytes | str) -> str:  # type: ignore[override]
        text = string.decode() if isinstance(string, bytes) else string
        return self.scheduler.parse_job_id(text)

    def _new_job(self, job_id: str, tasks: list[int]) -> core.Job[tp.Any]:
        # A ScriptJob (or subclass): it takes the scheduler; PBSExecutor has its own _new_job.
        make = tp.cast("type[ScriptJob[tp.Any]]", self.job_class)
        return make(folder=self.folder, job_id=job_id, tasks=tasks, scheduler=self.scheduler)

    def _submit_job(self, job: Job) -> core.Job[tp.Any]:
        """Write ``job``'s script and submit it with the scheduler's own ``submit``."""
        from hpc.core import render_job

        uid = uuid.uuid4().hex
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f".submission_file_{uid}{job.cluster.script_suffix}"
        path.write_text(render_job(job))
        sub = job.scheduler.submit(str(path), str(self.folder))
        out = self._new_job(sub.job_id, list(range(job.ranks)))
        out.paths.move_temporary_file(path, "submission_file", keep_as_symlink=True)
        return out

    def _submit_command(self, command: str) -> core.Job[tp.Any]:
        return self._submit_job(self.resolve())

    def _internal_process_submissions(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[core.Job[tp.Any]]:
        jobs = self._submit_all(delayed_submissions)
        self._record(jobs)
        return jobs

    def _submit_all(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[core.Job[tp.Any]]:
        """One submission: one job. Several: the scheduler's array of them, else one job each."""
        job = self.resolve()
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickles = []
        for delayed in delayed_submissions:
            path = folder / f"{uuid.uuid4().hex}.pkl"
            delayed.set_timeout(job.walltime / 60, self.max_num_timeout)  # type: ignore[arg-type]
            delayed.dump(path)
            pickles.append(path)
        size = sum(p.stat().st_size for p in pickles) / 1024**3
        if size > self.max_pickle_size_gb:
            for p in pickles:
                p.unlink()
            raise UserError(
                f"submission: {size:.2f} GB of pickled functions and arguments; "
                f"allowed: up to max_pickle_size_gb={self.max_pickle_size_gb}"
            )
        self._throttle()
        self._last_job_submitted = time.time()
        array = self.scheduler.submitit_array(job, len(pickles)) if len(pickles) > 1 else None
        if array is None:
            jobs = []
            for path in pickles:
                one = self._submit_job(job)
                one.paths.move_temporary_file(path, "submitted_pickle")
                jobs.append(one)
            return jobs
        first = self._submit_job(array)
        tasks = list(range(first.num_tasks))
        jobs = [self._new_job(f"{first.job_id}_{i}", tasks) for i in range(len(pickles))]
        for sub, path in zip(jobs, pickles, strict=True):
            sub.paths.move_temporary_file(path, "submitted_pickle")
        return jobs


# --- the entry point on the compute node --------------------------------------------


class ScriptJobEnvironment(job_environment.JobEnvironment):
    """A rank as torchrun's variables describe it (exported by the launcher or by
    ``ddp.exec``), in the job whose id the script exported."""

    _env: tp.ClassVar[dict[str, str]] = {
        "job_id": JOB_ID_VAR,
        "num_tasks": "WORLD_SIZE",
        "num_nodes": "HPC_SUBMITIT_NUM_NODES",
        "node": "GROUP_RANK",
        "global_rank": "RANK",
        "local_rank": "LOCAL_RANK",
    }


def _ensure_registered(env: job_environment.JobEnvironment) -> None:
    """Make submitit find ``env`` even where no entry point names it."""
    from submitit.core import plugins

    if env.name() in plugins.get_job_environments():
        return
    plugins._get_plugins()[1].append(env)
    plugins.get_job_environments.cache_clear()


def run_rank(folder: str, env: job_environment.JobEnvironment) -> None:
    """Run one rank's share of the submitit job in ``folder`` under ``env``: its own
    ``%j_%t_log.out/err``, as srun --output writes them on SLURM."""
    from submitit.core.submission import process_job

    os.environ.setdefault("SUBMITIT_EXECUTOR", env.name())
    _ensure_registered(env)
    paths = utils.JobPaths(folder, job_id=env.job_id, task_id=env.global_rank)
    _redirect(paths.stdout, paths.stderr)
    process_job(folder)


def _redirect(stdout: Path, stderr: Path) -> None:
    stdout.parent.mkdir(parents=True, exist_ok=True)
    for path, fd in ((stdout, 1), (stderr, 2)):
        sys.stdout.flush()
        sys.stderr.flush()
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def main(argv: list[str] | None = None) -> None:
    """``python -m hpc.executors.script FOLDER``: one rank of a submitit job."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m hpc.executors.script FOLDER")
    run_rank(args[0], ScriptJobEnvironment())


if __name__ == "__main__":
    # Run the importable module's main, so its classes are the ones submitit registers.
    from hpc.executors.script import main as _main

    _main()
