"""A submitit plugin for PBS Pro (ALCF Aurora and Polaris, any PBS Pro site).

submitit ships executors for SLURM and this machine only. This module adds the
four pieces a submitit plugin consists of, so that ``hpc.executor(cluster="aurora")``
(and ``submitit.AutoExecutor`` once the ``submitit`` entry points name this module)
pickle a function, run it on the compute nodes and bring its result back:

- ``PBSExecutor``: renders the job script through the same template and cluster
  profile as ``hpc render`` (``#PBS -l select=N:system=..``, ``place``, ``walltime``,
  ``filesystems``, ``-q``, ``-A``, ``-N``, ``-o`` into the job folder) with the launch
  line ``mpiexec -n RANKS --ppn PPN [site flags] python -u -m hpc.executors.pbs FOLDER``,
  and submits it with ``qsub`` (the job id is the id line qsub prints). Several
  submissions at once (``map_array``) become one PBS job array (``-J 0-N``).
- ``PBSJob`` / ``PBSInfoWatcher``: state from the one PBS client,
  ``hpc.schedulers.pbs.query`` (``qstat -x -f -F json`` for all watched jobs, else
  ``qstat -f`` text, else plain ``qstat``), the same answer ``hpc status`` gives;
  ``qdel`` cancels.
- ``PBSJobEnvironment`` (``hpc.executors.pbs_env``): what a rank knows on the
  compute node, and the requeue that PBS lacks.

Preemption and timeouts. PBS has no ``--signal=USR2@90`` and no ``scontrol requeue``:

- The job script exports ``SUBMITIT_PBS_DEADLINE`` (start + walltime - delay) and
  each rank arms a timer that sends itself the preemption signal (USR2) then; the
  batch shell and ``mpiexec`` ignore that signal (``trap '' USR2``). The timer is the
  only reliable source: ``qsig -s USR2`` (``PBSJob._interrupt``) goes to the job's
  session, where on a real OpenPBS 23.06 server the login shell that PBS runs the
  script from dies of it (PBS then reports the job finished, substate 92, Exit_status
  0) and MPICH hydra's ranks, in sessions of their own, never see it.
- On the signal, rank 0 checkpoints a ``submitit.helpers.Checkpointable`` as submitit
  does, then ``_requeue`` submits a copy of the same script with ``qsub`` (from the
  compute node: ``$PBS_EXEC/bin/qsub`` of ``/etc/pbs.conf``, see ``pbs_client``). The copy
  exports ``SUBMITIT_PBS_JOB_ID`` so the new PBS job reads and writes the files of
  the original submitit job id, and the new PBS id is appended to
  ``FOLDER/<id>_pbs_ids``; ``PBSJob`` follows that file, so ``job.result()`` waits
  for the newest PBS job. Limitation: the new job queues again from the start (no
  priority kept), gets a new PBS id (``qstat``/``qdel`` by hand need that id, see
  ``job.scheduler_id``), and a job array's subjob comes back as a plain job.
- A PBS preemption that kills (SIGTERM, then SIGKILL) is not told apart from ``qdel``
  and is not requeued; a site whose preemption method is ``qrerun`` reruns the job
  under the same id, which restarts the function from its last checkpoint pickle.

Unlike the rest of ``hpc``, this package imports submitit at module level: it *is* a
submitit plugin (its classes derive from submitit's). Only ``hpc.executors.api`` (on
first use) and submitit's plugin discovery import it; ``import hpc`` does not.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import typing as tp
import uuid
from pathlib import Path

from submitit.core import core, logger, utils

from hpc.errors import SchedulerError, UserError
from hpc.executors.params import signal_of
from hpc.executors.pbs_env import PBSJobEnvironment, ids_file
from hpc.schedulers.pbs import query

# --- the job, seen from the submitting side -----------------------------------------


class PBSInfoWatcher(core.InfoWatcher):
    """One qstat call for every watched job, at growing intervals (submitit's schedule)."""

    def update(self) -> None:
        """Query all unfinished jobs through :func:`query` (JSON, then text, then plain)."""
        to_check = sorted(self._registered - self._finished)
        if not to_check:
            return
        self._num_calls += 1
        logger.get_logger().debug(f"Call #{self.num_calls} - qstat for {' '.join(to_check)}")
        self._info_dict.update(query(to_check))
        self._last_status_check = time.time()
        for job_id in to_check:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        """Normalized state: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ..."""
        return self.get_info(job_id, mode=mode).get("State") or "UNKNOWN"


# --- the job, seen from the submitting side -----------------------------------------


class PBSJob(core.Job[core.R]):
    """A submitted PBS job; follows the job across requeues (see the module docstring)."""

    _cancel_command = "qdel"
    watcher = PBSInfoWatcher(delay_s=60)

    @property
    def scheduler_id(self) -> str:
        """The PBS id of the newest incarnation of this job (the submitted one unless requeued)."""
        try:
            ids = ids_file(self.paths.folder, self.job_id).read_text().split()
        except OSError:
            return self.job_id
        return ids[-1] if ids else self.job_id

    def done(self, force_check: bool = False) -> bool:
        """Result pickle present, or PBS says the newest incarnation has ended."""
        if self._sub_jobs:
            return all(sub.done(force_check) for sub in self._sub_jobs)
        folder = self.paths.folder
        try:  # refresh an NFS attribute cache, as submitit does
            folder.chmod(folder.stat().st_mode)
        except OSError:
            pass
        if self.paths.result_pickle.exists():
            return True
        return self.watcher.is_done(self.scheduler_id, mode="force" if force_check else "standard")

    @property
    def state(self) -> str:
        """Normalized state of the newest incarnation (no forced qstat call)."""
        return self.watcher.get_state(self.scheduler_id, mode="standard")

    def get_info(self, mode: str = "force") -> dict[str, str]:
        """qstat's view of the newest incarnation."""
        return self.watcher.get_info(self.scheduler_id, mode=mode)

    def cancel(self, check: bool = True) -> None:
        """``qdel`` the newest incarnation (``check``: raise when qdel fails)."""
        argv = ["qdel", self.scheduler_id]
        (subprocess.check_call if check else subprocess.call)(argv, shell=False)

    def _interrupt(self, timeout: bool = False) -> None:
        """Send the preemption signal to the job's processes, as ``qsig -s USR2``.

        ``timeout`` is accepted for submitit's signature; on PBS the ranks tell a
        timeout from a preemption by the time they have run (submitit's rule). Caution:
        on the real server this ends the job instead (see the module docstring); the
        tests preempt through the ranks' timer and ``qrerun``.
        """
        sig = "SIG" + PBSJobEnvironment.USR_SIG
        subprocess.check_call(["qsig", "-s", sig, self.scheduler_id])


# --- the executor -------------------------------------------------------------------

#: JobSpec keys a PBSExecutor takes as parameters (the command and logs are its own).
SPEC_PARAMETERS = (
    "name", "nodes", "ppn", "walltime", "queue", "account", "env", "modules", "setup",
    "python", "signal", "requeue", "directives", "launcher", "gpus_per_node",
    "cpus_per_task", "filesystems",
)


class PBSExecutor(core.PicklingExecutor):
    """PBS Pro executor: pickles calls, renders and qsubs a job script per submission.

    ``cluster`` names a profile (``hpc clusters``: aurora, polaris, pbs, ...) whose site
    facts (system, place, filesystems, queues and their limits, launcher flags,
    modules, environment) fill the script; parameters are the job spec's keys
    (``nodes``, ``ppn``, ``walltime``, ``queue``, ``account``, ``env``, ...), checked
    exactly as ``hpc render`` checks them. submitit's generic names work too
    (``timeout_min``, ``tasks_per_node``, ``gpus_per_node``, ``cpus_per_task``).
    ``python`` is the interpreter command on the compute nodes (default: this one).
    """

    job_class = PBSJob

    def __init__(
        self,
        folder: str | Path,
        max_num_timeout: int = 3,
        max_pickle_size_gb: float = 1.0,
        python: str | None = None,
        cluster: str = "pbs",
    ) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout,
                         max_pickle_size_gb=max_pickle_size_gb)
        self.python = python if python is not None else shlex.quote(sys.executable)
        self.parameters = {"cluster": cluster}
        self._array_size: int | None = None

    @classmethod
    def _equivalence_dict(cls) -> core.EquivalenceDict:
        return {
            "name": "name", "timeout_min": "timeout_min", "mem_gb": "mem_gb", "nodes": "nodes",
            "cpus_per_task": "cpus_per_task", "gpus_per_node": "gpus_per_node",
            "tasks_per_node": "ppn",
        }

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return {*SPEC_PARAMETERS, "cluster", "timeout_min", "signal_delay_s", "tasks_per_node"}

    @classmethod
    def affinity(cls) -> int:
        """Available with qsub on PATH; ranked below SLURM where sbatch exists too
        (SLURM's ``slurm-wlm-torque`` installs a qsub wrapper)."""
        if shutil.which("qsub") is None:
            return -1
        return 1 if shutil.which("sbatch") else 2

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        """Check the new parameters by resolving the job (same checks as ``hpc render``)."""
        from hpc._util import check_keys

        check_keys(kwargs, sorted(self._valid_parameters()), "PBSExecutor parameters")
        if "mem_gb" in kwargs:
            raise UserError("mem_gb: PBS memory requests are not in the job template; "
                            "allowed: leave it out (nodes are allocated whole)")
        if "tasks_per_node" in kwargs:
            kwargs["ppn"] = kwargs.pop("tasks_per_node")
        if "timeout_min" in kwargs:
            kwargs["walltime"] = max(60, int(round(float(kwargs.pop("timeout_min")) * 60)))
        merged = {**self.parameters, **kwargs}
        self.resolve(merged)
        self.parameters = merged

    def _command(self) -> list[str]:
        return [*shlex.split(self.python), "-u", "-m", "hpc.executors.pbs", str(self.folder)]

    def resolve(self, parameters: dict[str, tp.Any] | None = None) -> tp.Any:
        """The ``hpc.spec.Job`` these parameters describe, with the submitit lines added."""
        from hpc.core import build_job

        params = dict(self.parameters if parameters is None else parameters)
        cluster = params.pop("cluster")
        delay = params.pop("signal_delay_s", None)
        if params.get("name") is None:
            params["name"] = "submitit"
        env = dict(params.pop("env", None) or {})
        overrides = {
            **params, "cluster": cluster, "command": self._command(),
            "output_dir": str(self.folder), "wrap": "never",
            "env": {**env, "SUBMITIT_EXECUTOR": "pbs"},
        }
        if self._array_size is not None:
            directives = list(overrides.get("directives") or [])
            overrides["directives"] = [*directives, f"-J 0-{self._array_size - 1}"]
        job = build_job(None, overrides)
        if job.launcher != "mpiexec":
            raise UserError(f"launcher: {job.launcher!r} cannot start submitit ranks on PBS; "
                            "allowed: auto, mpiexec")
        sig, sig_delay = signal_of(job.spec.signal, delay)
        lines = [
            "# submitit: the ranks take the preemption signal; this shell and mpiexec ignore it",
            f"trap '' {sig}",
            f"export SUBMITIT_PREEMPT_SIGNAL={sig}",
        ]
        if job.walltime > sig_delay:
            lines.append(f"export SUBMITIT_PBS_DEADLINE=$(( $(date +%s) + {job.walltime - sig_delay} ))")
        return job.with_spec(setup=[*job.spec.setup, *lines],
                             source="hpc.executor (submitit PBS plugin)")

    def _num_tasks(self) -> int:
        return int(self.resolve().ranks)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        from hpc.core import render_job

        return render_job(self.resolve())

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return ["qsub", str(submission_file_path)]

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        from hpc.schedulers.pbs import PBS

        return PBS().parse_job_id(string.decode() if isinstance(string, bytes) else string)

    @property
    def _submitit_command_str(self) -> str:
        return shlex.join(self._command())

    def _submit_command(self, command: str) -> core.Job[tp.Any]:
        """Write the script, qsub it, and return the job (a refusal is one clear line)."""
        from hpc.schedulers import last_line, run

        uid = uuid.uuid4().hex
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f".submission_file_{uid}.pbs"
        path.write_text(self._make_submission_file_text(command, uid))
        proc = run(self._make_submission_command(path))
        if proc.returncode != 0:
            raise SchedulerError(f"qsub refused the job (exit {proc.returncode}): "
                                 f"{last_line(proc.stderr or proc.stdout)}")
        job_id = self._get_job_id_from_submission_command(proc.stdout)
        job: core.Job[tp.Any] = self.job_class(folder=self.folder, job_id=job_id,
                                               tasks=list(range(self._num_tasks())))
        job.paths.move_temporary_file(path, "submission_file", keep_as_symlink=True)
        return job

    def _internal_process_submissions(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[core.Job[tp.Any]]:
        """One submission: one PBS job. Several: one PBS job array, ``-J 0-(N-1)``."""
        job = self.resolve()
        timeout_min = job.walltime / 60
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickles = []
        for delayed in delayed_submissions:
            path = folder / f"{uuid.uuid4().hex}.pkl"
            delayed.set_timeout(timeout_min, self.max_num_timeout)  # type: ignore[arg-type]
            delayed.dump(path)
            pickles.append(path)
        size = sum(p.stat().st_size for p in pickles) / 1024**3
        if size > self.max_pickle_size_gb:
            for p in pickles:
                p.unlink()
            raise UserError(f"submission: {size:.2f} GB of pickled functions and arguments; "
                            f"allowed: up to max_pickle_size_gb={self.max_pickle_size_gb}")
        self._throttle()
        self._last_job_submitted = time.time()
        if len(delayed_submissions) == 1:
            first = self._submit_command(self._submitit_command_str)
            first.paths.move_temporary_file(pickles[0], "submitted_pickle")
            return [first]
        self._array_size = len(delayed_submissions)
        try:
            first = self._submit_command(self._submitit_command_str)
        finally:
            self._array_size = None
        tasks = list(range(first.num_tasks))
        jobs: list[core.Job[tp.Any]] = [
            PBSJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=tasks)
            for i in range(len(delayed_submissions))
        ]
        for sub, path in zip(jobs, pickles, strict=True):
            sub.paths.move_temporary_file(path, "submitted_pickle")
        return jobs


# --- the entry point on the compute node --------------------------------------------


def _ensure_registered() -> None:
    """Make submitit find PBSJobEnvironment even before the entry points are installed."""
    from submitit.core import plugins

    if "pbs" in plugins.get_job_environments():
        return
    plugins._get_plugins()[1].append(PBSJobEnvironment())
    plugins.get_job_environments.cache_clear()


def _redirect(stdout: Path, stderr: Path) -> None:
    """Each rank writes its own ``%j_%t_log.out/err``, as srun --output does on SLURM."""
    stdout.parent.mkdir(parents=True, exist_ok=True)
    for path, fd in ((stdout, 1), (stderr, 2)):
        sys.stdout.flush()
        sys.stderr.flush()
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def main(argv: list[str] | None = None) -> None:
    """``python -m hpc.executors.pbs FOLDER``: one rank of a submitit PBS job."""
    from submitit.core.submission import process_job

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m hpc.executors.pbs FOLDER")
    os.environ.setdefault("SUBMITIT_EXECUTOR", "pbs")
    _ensure_registered()
    env = PBSJobEnvironment()
    paths = utils.JobPaths(args[0], job_id=env.job_id, task_id=env.global_rank)
    _redirect(paths.stdout, paths.stderr)
    process_job(args[0])


#: What submitit's plugin discovery reads (entry points ``executor`` and ``job_environment``).
executor = PBSExecutor
job_environment = PBSJobEnvironment

if __name__ == "__main__":
    # Run the importable module's main, so its classes are the ones submitit registers.
    from hpc.executors.pbs import main as _main

    _main()
