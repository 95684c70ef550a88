"""Submitting one job: :func:`plan_submit` decides, :func:`submit` writes and queues.

Two steps so that a dry run shows exactly what a submission writes: :func:`plan_submit`
decides the run directory and renders the script (no side effects), :func:`submit`
creates the directory, writes the script, the resolved spec and ``run.json``, and
calls the scheduler. What a submission of several jobs adds (a sweep's tasks and
arrays, a chain's segments) is :mod:`hpc.submit_many`. ``hpc.core`` re-exports these
names: it is the library the CLI and users call.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import UserError
from hpc.job import Job
from hpc.submit_many import _check_chain, _plan_sweep, _submit_chain, _submit_parts

if TYPE_CHECKING:
    from hpc.chain import After
    from hpc.schedulers import Scheduler, Submission
    from hpc.sweep import SweepTask


@dataclass(frozen=True)
class Plan:
    """A submission decided but not done: where it goes, the script, the submit command."""

    job: Job
    run_dir: Path
    resume: bool
    script: Path
    text: str
    argv: tuple[str, ...]
    regenerate: str | None
    templates: str | None
    now: float
    #: A sweep's tasks (the job is an array of them); written as ``sweep.json`` on submit.
    sweep: tuple[SweepTask, ...] = ()
    #: Segments queued one after another (``--chain N``, ``hpc.chain``); 1: one job.
    chain: int = 1
    #: The first segment's dependency (``--after JOBID[:KIND]``).
    after: After | None = None
    #: Lines for stderr, said once (a sweep throttled to its queue's array limit).
    notes: tuple[str, ...] = ()
    #: ``(offset, count)`` of each array of a sweep wider than the cluster's array size
    #: (``hpc.sweep.split``); empty: the sweep is one array.
    parts: tuple[tuple[int, int], ...] = ()

    @property
    def scheduler(self) -> Scheduler:
        """The job's scheduler."""
        return self.job.scheduler


@dataclass(frozen=True)
class Submitted:
    """A submission done: its run directory and what the scheduler answered."""

    run_dir: Path
    script: Path
    submission: Submission


def plan_submit(
    job: Job,
    runs_dir: Path,
    resume: str | None = None,
    regenerate: str | None = None,
    templates: str | None = None,
    environ: Mapping[str, str] | None = None,
    now: float | None = None,
    sweep: list[SweepTask] | None = None,
    max_parallel: int | None = None,
    chain: int = 1,
    after: After | None = None,
) -> Plan:
    """Decide the run directory and render the script that :func:`submit` will write.

    The job runs with the Python this runs from unless the spec names one (see
    :func:`hpc.spec.submitting_python`), keeps its log in the run directory where the
    scheduler writes it, and learns where that is from ``HPC_RUN_DIR`` (the trainer's
    default checkpoint folder is ``$HPC_RUN_DIR/checkpoints``, so a requeued or
    resumed job continues there).

    A ``sweep`` makes the job an array of its tasks, each with its own ``--set``
    overrides and folder (``hpc.sweep``); ``--resume`` of a sweep's run directory
    submits the same array again, from its ``sweep.json``.
    """
    from hpc import runs
    from hpc import stage as staging
    from hpc.core import render_job
    from hpc.spec import submitting_python

    scheduler = job.scheduler
    runs.check_runs_dir(runs_dir)
    scheduler.check_runs_dir(runs_dir)
    now = time.time() if now is None else now
    record = None
    if resume:
        found = runs.find(resume, runs_dir)
        if found is None:
            raise UserError(
                f"resume: {resume!r} is not a run directory (no run.json); "
                "allowed: a directory made by hpc submit, or its name under --runs-dir"
            )
        run_dir, record = found
    else:
        run_dir = runs.free_run_dir(runs_dir, job.name, now)
    job, tasks, notes, parts = _plan_sweep(job, run_dir, record, sweep, max_parallel)
    chain = _check_chain(job, chain, after)
    if chain > 1:
        job = replace(job, chain=True)
    if job.spec.python is None:
        job = job.with_spec(python=submitting_python(os.environ if environ is None else environ))
    stage = staging.decide(job)
    if stage is not None:  # the venv goes to each node's local storage first
        staging.note(stage)
        job = replace(job, stage=stage)
    run_abs = str(run_dir.resolve())
    job = job.with_spec(env={**job.spec.env, "HPC_RUN_DIR": run_abs})
    if not scheduler.runs_here:  # the scheduler writes the log where the script says
        job = job.with_spec(output_dir=run_abs)
    script = runs.free_name(run_dir, "job", job.cluster.script_suffix)
    return Plan(
        job=job,
        run_dir=run_dir,
        resume=bool(resume),
        script=script,
        text=render_job(job, regenerate, templates),
        argv=tuple(_submit_command(scheduler, str(script), after)),
        regenerate=regenerate,
        templates=templates,
        now=now,
        sweep=tuple(tasks),
        chain=chain,
        after=after,
        notes=tuple(notes),
        parts=tuple(parts) if len(parts) > 1 else (),
    )


def _submit_command(scheduler: Scheduler, script: str, after: After | None) -> list[str]:
    """The submit command; ``after`` only when given, so a user's scheduler written before
    ``--after`` existed (``submit_command(self, script)``) still works."""
    return (
        scheduler.submit_command(script, after)
        if after is not None
        else scheduler.submit_command(script)
    )


def submit(plan: Plan, on_start: Callable[[str], None] | None = None) -> Submitted:
    """Create the run directory, write the script, spec and record, and submit.

    A name taken since the plan was made (another submission in the same second) gets
    the next free one, and the script is rendered again for it.
    """
    from hpc import runs
    from hpc.core import render_job

    job = plan.job
    if plan.resume:
        run_dir = plan.run_dir
    else:
        run_dir = runs.new_run_dir(plan.run_dir.parent, job.name, plan.now)
    text = plan.text
    if run_dir != plan.run_dir:
        job = _moved(job, plan.run_dir, run_dir)
        text = render_job(job, plan.regenerate, plan.templates)
    if job.stage is not None and job.stage.pack_at == "submit":
        _pack(job.stage, run_dir, fresh=not plan.resume)
    scheduler = job.scheduler
    script = _write_run(plan, job, run_dir, text)

    def started(job_id: str) -> None:  # a local run records its id before it ends
        runs.update_submission(run_dir, str(script), job_id=job_id, state="RUNNING")
        if on_start is not None:
            on_start(job_id)

    try:
        deps = {"after": plan.after} if plan.after is not None else {}  # a user's scheduler
        sub = scheduler.submit(str(script), str(run_dir), on_start=started, **deps)
    except Exception as exc:
        runs.update_submission(run_dir, str(script), error=str(exc))
        raise
    changes: dict[str, Any] = {"job_id": sub.job_id}
    if plan.after is not None:
        changes["after"] = f"{plan.after.job_id}:{plan.after.kind}"
    if plan.parts:  # a sweep wider than the cluster's array size: its other arrays
        changes["array_parts"] = _submit_parts(plan, scheduler, str(script), run_dir, sub.job_id)
    if plan.chain > 1:
        changes["chain"] = _submit_chain(scheduler, plan.chain, str(script), run_dir, sub.job_id)
    if sub.exit_code is not None:
        changes.update(exit_code=sub.exit_code, state=str(sub.state))
    runs.update_submission(run_dir, str(script), **changes)
    return Submitted(run_dir=run_dir, script=script, submission=sub)


def _write_run(plan: Plan, job: Job, run_dir: Path, text: str) -> Path:
    """Write the script, the resolved spec, a sweep's manifest and ``run.json`` (a
    resumed run's earlier submissions kept in it) under the run's lock; the script."""
    import yaml

    from hpc import runs

    git = runs.git_info()
    with runs.locked(run_dir):  # concurrent --resume calls: names and history stay whole
        previous = runs.read_record(run_dir) if plan.resume else None
        script = runs.create_free(run_dir, "job", job.cluster.script_suffix, text)
        runs.create_free(
            run_dir,
            "spec",
            ".yaml",
            yaml.safe_dump(job.to_dict(), sort_keys=False, allow_unicode=True),
        )
        if plan.sweep and not plan.resume:
            from hpc.sweep import write_manifest

            write_manifest(run_dir, list(plan.sweep), job.max_parallel)
        argv = job.scheduler.submit_command(str(script))
        record = runs.new_record(job, git, script=str(script), submit_command=shlex.join(argv))
        if job.spec.split_logs:  # hpc logs --err: the job's stderr has its own file
            record["split_logs"] = True
        if plan.sweep:  # a line per task: its index, overrides and folder
            record["sweep"] = [
                {"index": t.index, "label": t.label, "dir": t.dirname} for t in plan.sweep
            ]
        if previous is not None:  # earlier submissions of this run, oldest first
            earlier = previous.pop("submissions", [])
            record["submissions"] = [*earlier, previous]
        runs.write_record(run_dir, record)
    return script


def _pack(stage: Any, run_dir: Path, fresh: bool) -> None:
    """Pack the venv before anything else is written, so a failed pack leaves no run
    record of a job that was never submitted (a new run's empty folder goes too)."""
    import sys

    from hpc import stage as staging

    try:
        print(f"hpc: {staging.pack(stage, run_dir)}", file=sys.stderr)
    except BaseException:
        if fresh:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise


def _moved(job: Job, old: Path, new: Path) -> Job:
    """The job with its run directory paths pointed at ``new`` instead of ``old``."""
    old_abs, new_abs = str(old.resolve()), str(new.resolve())
    env = {k: (new_abs if v == old_abs else v) for k, v in job.spec.env.items()}
    out = new_abs if job.spec.output_dir == old_abs else job.spec.output_dir
    return job.with_spec(env=env, output_dir=out)
