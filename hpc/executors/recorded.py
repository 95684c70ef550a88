"""submitit executors that note what they submit in a run directory's ``run.json``.

``hpc.executor`` leaves a run directory like ``hpc submit`` does; each submission's
ids are added to its record (in the form the scheduler's clients take, which is the
scheduler's to say: :meth:`hpc.schedulers.Scheduler.record_ids`), so ``hpc status
RUN``, ``hpc logs RUN`` and ``hpc cancel RUN`` find the jobs.

Why subclasses declared here, each with its base's own name: submitit derives an
executor's name (``Executor.name()``: ``LocalExecutor`` -> ``local``) and its job
environment's from the class name, so a renamed subclass would run its ranks under
an environment nobody registered.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import submitit

if TYPE_CHECKING:
    from hpc.schedulers import Scheduler


class Recorded:
    """Mixin for a submitit executor: adds its jobs' ids to ``run_dir/run.json``."""

    def __init__(
        self,
        *args: Any,
        run_dir: Path | None = None,
        scheduler: Scheduler | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        #: The run directory whose record is kept (None: a plain folder, no record).
        self.run_dir = run_dir
        self._record_scheduler = scheduler

    def _recording_scheduler(self) -> Scheduler | None:
        """Whose ``record_ids`` say how the ids are written down."""
        return self._record_scheduler

    def _record(self, jobs: list[Any]) -> None:
        """Add ``jobs``' ids to the run record (nothing without a run directory)."""
        scheduler = self._recording_scheduler()
        if self.run_dir is not None and scheduler is not None:
            from hpc import runs

            runs.add_job_ids(self.run_dir, scheduler.record_ids([str(j.job_id) for j in jobs]))

    def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
        jobs = list(super()._internal_process_submissions(delayed_submissions))  # type: ignore[misc]
        self._record(jobs)
        return jobs


class LocalExecutor(Recorded, submitit.LocalExecutor):
    """submitit's LocalExecutor, its submissions recorded (see :class:`Recorded`)."""


class SlurmExecutor(Recorded, submitit.SlurmExecutor):
    """submitit's SlurmExecutor, its submissions recorded (see :class:`Recorded`); its
    srun tasks run ``hpc.executors.slurm_env`` (submitit's entry with a requeue that
    survives the requeue's own SIGTERM)."""

    @property
    def _submitit_command_str(self) -> str:
        return " ".join(
            [self.python, "-u -m hpc.executors.slurm_env", shlex.quote(str(self.folder))]
        )
