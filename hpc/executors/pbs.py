"""A submitit plugin for PBS Pro (ALCF Aurora and Polaris, any PBS Pro site).

submitit ships executors for SLURM and this machine only. This module adds the
four pieces a submitit plugin consists of, so that ``hpc.executor(cluster="aurora")``
(and ``submitit.AutoExecutor`` once the ``submitit`` entry points name this module)
pickle a function, run it on the compute nodes and bring its result back:

- ``PBSExecutor``: renders the job script through the same template and cluster
  profile as ``hpc render`` (``#PBS -l select=N:system=..``, ``place``, ``walltime``,
  ``filesystems``, ``-q``, ``-A``, ``-N``, ``-o`` into the job folder) with the launch
  line ``mpiexec -n RANKS --ppn PPN [site flags] python -u -m hpc.executors.pbs FOLDER``,
  and submits it with ``hpc.schedulers.pbs.PBS.submit`` (``qsub``; the job id is the
  id line qsub prints), as ``hpc submit`` does. It is ``hpc.executors.script``'s
  executor with PBS's additions, and holds the resolved, frozen Job. Several
  submissions at once (``map_array``) become one PBS job array (``-J 0-N``, added by
  ``PBS.submitit_array`` to a copy of the Job).
- ``PBSJob`` / ``PBSInfoWatcher``: state from the one PBS client,
  ``hpc.schedulers.pbs.query`` (``qstat -x -f -F json`` for all watched jobs, else
  ``qstat -f`` text, else plain ``qstat``), the same answer ``hpc status`` gives;
  ``PBS.cancel`` (``qdel``) cancels, a refusal its one-line ``SchedulerError``.
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

import shutil
import sys
import time
import typing as tp
from dataclasses import replace

from submitit.core import core, logger

from hpc.errors import SchedulerError
from hpc.executors.params import signal_of
from hpc.executors.pbs_env import PBSJobEnvironment, ids_file
from hpc.executors.script import SPEC_PARAMETERS, ScriptExecutor, ScriptJob, run_rank
from hpc.schedulers.pbs import query

if tp.TYPE_CHECKING:
    from hpc.job import Job
    from hpc.schedulers import Scheduler

__all__ = ["SPEC_PARAMETERS", "PBSExecutor", "PBSInfoWatcher", "PBSJob", "main"]

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


class PBSJob(ScriptJob[core.R]):
    """A submitted PBS job; follows the job across requeues (see the module docstring).

    :class:`~hpc.executors.script_job.ScriptJob`'s done, state and cancel (``PBS.cancel``,
    ``qdel``: a refusal is its one-line ``SchedulerError``), with one qstat watcher for
    every PBS job of this process and the PBS id of the newest incarnation."""

    _cancel_command = "qdel"
    watcher = PBSInfoWatcher(delay_s=60)

    @classmethod
    def _scheduler_by_id(cls, job_id: str) -> Scheduler:
        """PBS, whatever the id: a PBS job is made by id alone (``PBSJob(folder, id)``)."""
        from hpc.schedulers.pbs import PBS

        return PBS()

    @property
    def scheduler_id(self) -> str:
        """The PBS id of the newest incarnation of this job (the submitted one unless requeued)."""
        try:
            ids = ids_file(self.paths.folder, self.job_id).read_text().split()
        except OSError:
            return self.job_id
        return ids[-1] if ids else self.job_id

    def _interrupt(self, timeout: bool = False) -> None:
        """Send the preemption signal to the job's processes, as ``qsig -s USR2``.

        ``timeout`` is accepted for submitit's signature; on PBS the ranks tell a
        timeout from a preemption by the time they have run (submitit's rule). Caution:
        on the real server this ends the job instead (see the module docstring); the
        tests preempt through the ranks' timer and ``qrerun``.
        """
        from hpc.schedulers import last_line, run

        sig = "SIG" + PBSJobEnvironment.USR_SIG
        proc = run(["qsig", "-s", sig, self.scheduler_id])
        if proc.returncode != 0:
            raise SchedulerError(
                f"qsig {self.scheduler_id} failed (exit {proc.returncode}): "
                f"{last_line(proc.stderr or proc.stdout)}"
            )


# --- the executor -------------------------------------------------------------------


class PBSExecutor(ScriptExecutor):
    """PBS Pro executor: pickles calls, renders and qsubs a job script per submission.

    ``cluster`` names a profile (``hpc clusters``: aurora, polaris, pbs, ...) whose site
    facts (system, place, filesystems, queues and their limits, launcher flags,
    modules, environment) fill the script; parameters are the job spec's keys
    (``nodes``, ``ppn``, ``walltime``, ``queue``, ``account``, ``env``, ...), checked
    exactly as ``hpc render`` checks them. submitit's generic names work too
    (``timeout_min``, ``tasks_per_node``, ``gpus_per_node``, ``cpus_per_task``).
    ``python`` is the interpreter command on the compute nodes (default: this one).
    ``job``: the resolved job itself (``hpc.executor``), kept as it is (frozen); the
    profile is read again only when parameters change. Submit and cancel are
    ``hpc.schedulers.pbs.PBS``'s (:class:`ScriptExecutor`).
    """

    job_class = PBSJob
    entry = "hpc.executors.pbs"

    @classmethod
    def default_cluster(cls) -> str:
        """The generic PBS profile (``hpc/clusters/pbs.yaml``)."""
        return "pbs"

    @classmethod
    def environment_name(cls) -> str:
        return PBSJobEnvironment.name()

    @classmethod
    def affinity(cls) -> int:
        """Available with qsub on PATH; ranked below SLURM where sbatch exists too
        (SLURM's ``slurm-wlm-torque`` installs a qsub wrapper)."""
        if shutil.which("qsub") is None:
            return -1
        return 1 if shutil.which("sbatch") else 2

    def _for_submitit(self, job: Job) -> Job:
        """``job`` as the plugin runs it: its ranks started by the launcher itself (they
        read PALS/MPICH variables), the preemption signal taken by the ranks only."""
        job.scheduler.check_submitit_launcher(job)
        env = {**job.spec.env, "SUBMITIT_EXECUTOR": self.environment_name()}
        job = job.with_spec(
            command=self._command(), output_dir=str(self.folder), env=env, wrap="never"
        )
        job = replace(job, wrapped=False)
        sig, sig_delay = signal_of(job.spec.signal, self.parameters.get("signal_delay_s"))
        lines = [
            "# submitit: the ranks take the preemption signal; this shell and mpiexec ignore it",
            f"trap '' {sig}",
            f"export SUBMITIT_PREEMPT_SIGNAL={sig}",
        ]
        if job.walltime > sig_delay:
            lines.append(
                f"export SUBMITIT_PBS_DEADLINE=$(( $(date +%s) + {job.walltime - sig_delay} ))"
            )
        return job.with_spec(
            setup=[*job.spec.setup, *lines], source="hpc.executor (submitit PBS plugin)"
        )


# --- the entry point on the compute node --------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """``python -m hpc.executors.pbs FOLDER``: one rank of a submitit PBS job."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m hpc.executors.pbs FOLDER")
    run_rank(args[0], PBSJobEnvironment())


#: What submitit's plugin discovery reads (entry points ``executor`` and ``job_environment``).
executor = PBSExecutor
job_environment = PBSJobEnvironment

if __name__ == "__main__":
    # Run the importable module's main, so its classes are the ones submitit registers.
    from hpc.executors.pbs import main as _main

    _main()
