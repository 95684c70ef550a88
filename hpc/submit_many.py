"""What a submission of several jobs adds to :mod:`hpc.submit`: a sweep's tasks and the
arrays it is split into (``hpc.sweep``), a chain's segments (``hpc.chain``), each
checked before anything is written and queued with no half sweep or half chain left.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import UserError
from hpc.job import Job

if TYPE_CHECKING:
    from hpc.chain import After
    from hpc.schedulers import Scheduler
    from hpc.submit import Plan
    from hpc.sweep import SweepTask


def _check_chain(job: Job, chain: int, after: After | None) -> int:
    """``--chain``/``--after`` against the scheduler and the queue's site rules (one
    line, exit 2, before anything is written or submitted)."""
    from hpc.chain import After, check_chain

    check_chain(chain)
    if chain > 1 and job.array_size:
        raise UserError(
            "--chain: a sweep's tasks share one run directory, so one task's end "
            "would end every task's chain; allowed: --chain or --sweep, not both"
        )
    if chain > 1 or after is not None:
        job.scheduler.dependency(after or After("0", "any"))  # no dependencies: one line
        # the queue the job lands in, named or picked (Perlmutter's default QOS is debug)
        queue = job.cluster.queues.get(job.queue or "") if job.queue else None
        if queue is not None and queue.no_dependencies:
            raise UserError(
                f"--chain/--after: the {job.cluster.name} queue {queue.name!r} takes "
                f"no job dependencies ({queue.no_dependencies}); allowed: another "
                "queue, or one job"
            )
        limit = queue.max_queued if queue is not None else None
        if queue is not None and limit is not None and chain > limit:
            raise UserError(
                f"--chain: {chain} segments; the {job.cluster.name} queue "
                f"{queue.name!r} takes at most {limit} queued jobs per user; "
                f"allowed: --chain 1 to {limit}"
            )
    return chain


def _sweep_tasks(
    run_dir: Path,
    resumed: dict[str, Any] | None,
    sweep: list[SweepTask] | None,
    max_parallel: int | None,
) -> tuple[list[SweepTask], int | None]:
    """The tasks and their --max-parallel: a new sweep's, or the resumed sweep run's.

    ``resumed`` is the record of the run a ``--resume`` names. A run is a sweep when its
    record lists tasks or it holds a ``sweep.json`` (even a damaged one, or a FIFO: then
    reading it says what is wrong, instead of resubmitting a sweep as one plain job). A
    ``--sweep`` on a run that was no sweep would submit an array whose every task fails
    to find its ``sweep.json``: refused here.
    """
    from hpc import sweep as sweeps
    from hpc.spec import SPEC_KEYS

    manifest = run_dir / sweeps.MANIFEST
    if resumed is not None and (resumed.get("sweep") or os.path.lexists(manifest)):
        if sweep:
            raise UserError(
                "--sweep: the run directory holds a sweep already; allowed: "
                "--resume alone (the same tasks again) or a new run"
            )
        if max_parallel is not None:
            raise UserError(
                "--max-parallel: the resumed sweep keeps its own; allowed: --resume alone"
            )
        return sweeps.read_sweep(run_dir)
    if resumed is not None and sweep:
        raise UserError(
            f"--sweep: {str(run_dir)!r} was not a sweep (no {sweeps.MANIFEST}), so "
            "its tasks would have no overrides to read; allowed: --resume alone "
            "(the same job again), or --sweep in a new run"
        )
    tasks = list(sweep or [])
    shape = sorted({k for t in tasks for k in t.overrides if k in SPEC_KEYS})
    if shape:
        raise UserError(
            f"--sweep: {', '.join(shape)} is the job's own (every task of an array "
            "gets the same allocation); allowed: trainer keys such as optim.lr, and "
            "one hpc submit per size for a scaling table (the trainer scales lr by "
            "its scaling.rule)"
        )
    if sweep is not None and len(tasks) == 1:
        raise UserError(
            "--sweep: one task; allowed: two or more values (a single value "
            "is --set KEY=VALUE on the command)"
        )
    if max_parallel is not None:
        if not tasks:
            raise UserError("--max-parallel: only with --sweep")
        sweeps.check_max_parallel(max_parallel, len(tasks))
    return tasks, max_parallel


def _plan_sweep(
    job: Job,
    run_dir: Path,
    record: dict[str, Any] | None,
    sweep: list[SweepTask] | None,
    max_parallel: int | None,
) -> tuple[Job, list[SweepTask], list[str], list[tuple[int, int]]]:
    """(the job as the first array of a sweep, its tasks, notes for stderr, the arrays it
    is split into) for :func:`plan_submit`; the job unchanged and no tasks for one job."""
    tasks, max_parallel = _sweep_tasks(run_dir, record, sweep, max_parallel)
    notes: list[str] = []
    if tasks:  # the queue's array limit (issue 32: Polaris prod takes 10 at once)
        from hpc.sweep import throttle

        q = job.cluster.queues.get(job.queue or "") if job.queue else None
        max_parallel, note = throttle(
            len(tasks),
            max_parallel,
            q.array_limit if q else None,
            f"the {job.cluster.name} queue {job.queue!r}",
        )
        notes += [note] if note else []
    parts = _array_parts(job, len(tasks), notes) if tasks else []
    if tasks:
        from hpc.sweep import check_checkpoint_dirs

        check_checkpoint_dirs(job.spec.command, tasks, run_dir)
    if tasks:  # the first array's size: all tasks, or the first part of a split sweep
        job = replace(job, array_size=parts[0][1], max_parallel=max_parallel)
    return job, tasks, notes, parts


def _array_parts(job: Job, n_tasks: int, notes: list[str]) -> list[tuple[int, int]]:
    """The arrays a sweep of ``n_tasks`` is submitted as: one, or (where the scheduler
    splits) one per ``MaxArraySize`` tasks read from the cluster now (issue 32)."""
    from hpc.sweep import split

    scheduler = job.scheduler
    limit = scheduler.array_size_limit() if scheduler.array_parts else None
    parts = split(n_tasks, limit)
    if min(count for _, count in parts) < scheduler.array_min_size:  # only at a limit of 2
        raise UserError(
            f"--sweep: {n_tasks} tasks in arrays of at most {limit} "
            f"({scheduler.array_size_setting}) leave one array of "
            f"{min(c for _, c in parts)} task, and {scheduler.name} takes no array "
            f"of fewer than {scheduler.array_min_size}; allowed: a multiple of "
            f"{limit} tasks"
        )
    if len(parts) > 1:
        paced = (
            (f", each after the one before (--max-parallel {job.max_parallel} holds for the sweep)")
            if job.max_parallel
            else ""
        )
        notes.append(
            f"hpc: {n_tasks} tasks exceed the cluster's array size ({limit}, "
            f"{scheduler.array_size_setting}): one sweep of {len(parts)} arrays{paced}"
        )
    return parts


def _submit_parts(
    plan: Plan, scheduler: Scheduler, script: str, run_dir: Path, first: str
) -> list[dict[str, Any]]:
    """Queue arrays 2..N of a split sweep. Each holds its own ``--after``; with a
    ``--max-parallel`` each waits for the one before (``afterany``), so no more than
    that many tasks of the sweep run at once. No half sweep: when a part is refused, the
    parts queued are cancelled and the one line says so (as for a chain)."""
    from hpc import runs
    from hpc.chain import After
    from hpc.errors import SchedulerError

    mp = plan.job.max_parallel
    done: list[dict[str, Any]] = [
        {"job_id": first, "offset": plan.parts[0][0], "count": plan.parts[0][1]}
    ]
    for k, (offset, count) in enumerate(plan.parts[1:], 2):
        after = After(done[-1]["job_id"], "any") if mp else plan.after
        try:
            sub = scheduler.submit_array_part(script, count, offset, mp, after)
        except Exception as exc:
            undone = []
            for part in reversed(done):
                try:
                    scheduler.cancel(str(part["job_id"]))
                except Exception:  # said in the one line below
                    undone.append(str(part["job_id"]))
            ids = ", ".join(str(p["job_id"]) for p in done)
            note = f"; could not cancel {', '.join(undone)}" if undone else ""
            message = (
                f"--sweep: array {k} of {len(plan.parts)} was refused ({exc}); cancelled "
                f"the {len(done)} array(s) already queued ({ids}){note}"
            )
            runs.update_submission(
                run_dir, script, error=message, state="CANCELLED", array_parts=done
            )
            raise SchedulerError(message) from exc
        done.append({"job_id": sub.job_id, "offset": offset, "count": count})
    return done


def _submit_chain(
    scheduler: Scheduler, count: int, script: str, run_dir: Path, first: str
) -> list[dict[str, Any]]:
    """Queue segments 2..count of a chain, each ``afterany`` the one before (the walltime
    kill of a segment must still start the next; ``hpc.chain``). No half chain: when a
    segment is refused, the ones queued are cancelled and the one line says so."""
    from hpc import runs
    from hpc.chain import After
    from hpc.errors import SchedulerError

    ids = [first]
    for k in range(2, count + 1):
        try:
            ids.append(scheduler.submit(script, str(run_dir), after=After(ids[-1], "any")).job_id)
        except Exception as exc:
            undone = []
            for job_id in reversed(ids):
                try:
                    scheduler.cancel(job_id)
                except Exception:
                    undone.append(job_id)
            note = f"; could not cancel {', '.join(undone)}" if undone else ""
            message = (
                f"--chain: segment {k} of {count} was refused ({exc}); cancelled the "
                f"{len(ids)} segment(s) already queued ({', '.join(ids)}){note}"
            )
            runs.update_submission(
                run_dir,
                script,
                error=message,
                state="CANCELLED",
                chain=[{"segment": i + 1, "job_id": j} for i, j in enumerate(ids)],
            )
            raise SchedulerError(message) from exc
    return [{"segment": i + 1, "job_id": j} for i, j in enumerate(ids)]
