"""A job of :class:`hpc.executors.script.ScriptExecutor`, seen from the submitting side.

Its state comes from the scheduler's own ``statuses`` (one call for every watched job
of that scheduler in this process), its cancel is the scheduler's own ``cancel``, so a
refusal is the same one-line ``SchedulerError`` as ``hpc cancel``'s.
"""

from __future__ import annotations

import time
import typing as tp
from pathlib import Path

from submitit.core import core

from hpc.errors import SchedulerError

if tp.TYPE_CHECKING:
    from hpc.schedulers import Scheduler


class StatesWatcher(core.InfoWatcher):
    """One ``Scheduler.statuses`` call for every watched job of one scheduler."""

    def __init__(self, scheduler: Scheduler, delay_s: int = 60) -> None:
        super().__init__(delay_s)
        self.scheduler = scheduler

    def update(self) -> None:
        to_check = sorted(self._registered - self._finished)
        if not to_check:
            return
        self._num_calls += 1
        states = self.scheduler.statuses(to_check)
        self._info_dict.update({j: {"JobID": j, "State": str(s)} for j, s in states.items()})
        self._last_status_check = time.time()
        for job_id in to_check:
            if states[job_id].ended:
                self._finished.add(job_id)

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.get_info(job_id, mode=mode).get("State") or "UNKNOWN"


_WATCHERS: dict[str, StatesWatcher] = {}


def watcher_of(scheduler: Scheduler) -> StatesWatcher:
    """The one watcher of ``scheduler``'s jobs in this process (one query for all)."""
    if scheduler.name not in _WATCHERS:
        _WATCHERS[scheduler.name] = StatesWatcher(scheduler)
    return _WATCHERS[scheduler.name]


#: The scheduler of each job id submitted from this process: submitit makes a job's
#: per-task jobs as ``cls(folder=, job_id=, tasks=)``, without other arguments.
_SCHEDULER_OF: dict[str, Scheduler] = {}


class ScriptJob(core.Job[core.R]):
    """A job submitted through a scheduler's own clients.

    :class:`hpc.executors.pbs.PBSJob` is this job with PBS's additions: its own watcher
    (qstat's full answer, kept for ``get_info``) and :attr:`scheduler_id` following a
    requeued job to its newest PBS id."""

    def __init__(
        self,
        folder: str | Path,
        job_id: str,
        tasks: tp.Sequence[int] = (0,),
        scheduler: Scheduler | None = None,
    ) -> None:
        if scheduler is None:
            scheduler = _SCHEDULER_OF.get(job_id) or self._scheduler_by_id(job_id)
        _SCHEDULER_OF[job_id] = scheduler
        self.scheduler = scheduler
        if type(self).watcher is core.Job.watcher:  # a class with its own watcher keeps it
            self.watcher = watcher_of(scheduler)  # before submitit registers the id with it
        super().__init__(folder, job_id, tasks)

    @classmethod
    def _scheduler_by_id(cls, job_id: str) -> Scheduler:
        """The scheduler of a job made by id alone and not submitted from this process
        (a KeyError here: its scheduler cannot be told from the id)."""
        raise KeyError(job_id)

    @property
    def scheduler_id(self) -> str:
        """The id the scheduler knows the job by now: the submitted one (PBSJob: the
        newest incarnation of a requeued job)."""
        return self.job_id

    def done(self, force_check: bool = False) -> bool:
        """Result pickle present, or the scheduler says the job has ended."""
        if self._sub_jobs:
            return all(sub.done(force_check) for sub in self._sub_jobs)
        folder = self.paths.folder
        try:  # refresh an NFS attribute cache, as submitit's own jobs do
            folder.chmod(folder.stat().st_mode)
        except OSError:
            pass
        if self.paths.result_pickle.exists():
            return True
        return self.watcher.is_done(self.scheduler_id, mode="force" if force_check else "standard")

    @property
    def state(self) -> str:
        """The scheduler's state of the job, normalized (no forced query)."""
        return self.watcher.get_state(self.scheduler_id, mode="standard")

    def get_info(self, mode: str = "force") -> dict[str, str]:
        """The watcher's record of the job."""
        return self.watcher.get_info(self.scheduler_id, mode=mode)

    def cancel(self, check: bool = True) -> None:
        """The scheduler's own cancel, as ``hpc cancel`` does (``check``: raise its
        one-line SchedulerError on a refusal, else ignore it)."""
        try:
            self.scheduler.cancel(self.scheduler_id)
        except SchedulerError:
            if check:
                raise
