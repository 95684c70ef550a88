"""The login side as a library: build, render, submit, status and cancel a job.

``hpc.cli`` is argument parsing and printing over these functions, and the Python
API (``hpc.executors``) builds its jobs through :func:`build_job` too, so a value
is checked the same way wherever it comes from. Nothing here prints.

Submitting is two steps so that a dry run shows exactly what a submission writes:
:func:`plan_submit` decides the run directory and renders the script (no side
effects), :func:`submit` creates the directory, writes the script, the resolved spec
and ``run.json``, and calls the scheduler.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import UserError
from hpc.job import Job, resolve

if TYPE_CHECKING:
    from hpc.chain import After
    from hpc.schedulers import JobState, Scheduler, Submission
    from hpc.sweep import SweepTask


def build_job(
    spec_path: str | None, overrides: dict[str, Any], environ: Mapping[str, str] | None = None,
    defer_account: bool = False, cwd: Path | None = None, run_here: bool = False,
) -> Job:
    """Spec file + overrides -> a resolved Job (all checks done, nothing written).

    ``run_here`` is ``hpc run`` of a cluster spec: the same command on this machine,
    one node and one rank unless asked; the site-only keys mean nothing here.
    """
    from hpc import profiles as clusters
    from hpc.spec import load_spec

    environ = os.environ if environ is None else environ
    spec = load_spec(spec_path, overrides)
    if run_here and spec.cluster != "local":
        ppn = str(overrides.get("ppn") or "").strip()
        spec = replace(spec, cluster="local", nodes=int(overrides.get("nodes") or 1),
                       ppn=int(ppn) if re.fullmatch("[0-9]+", ppn) else None, queue=None,
                       account=None, gpus_per_node=None, filesystems=None, launcher="auto")
    if spec.cluster is None:
        raise UserError(
            "cluster: missing; allowed: --cluster NAME or cluster: in the spec, one of "
            + ", ".join(clusters.names(dict(environ), cwd))
        )
    profile = clusters.load(spec.cluster, dict(environ), cwd)
    return resolve(spec, profile, dict(environ), defer_account)


def render_job(job: Job, regenerate: str | None = None, templates: str | None = None,
               script: str | None = None) -> str:
    """The job script (see :func:`hpc.render.render`)."""
    from hpc.render import render

    return render(job, regenerate=regenerate, templates=templates, script=script)


def render_all(jobs_dir: Path, templates: str | None = None) -> dict[Path, str]:
    """Every ``jobs_dir/*.yaml`` rendered to ``jobs_dir/NAME.{pbs,slurm,sh}``.

    Independent of the caller's environment (no account from ``$PBS_ACCOUNT``, no
    user profiles): the checked-in scripts must be the same on every machine. A
    missing account is left to the submit command (``qsub -A PROJECT``).
    """
    specs = sorted(jobs_dir.glob("*.yaml"))
    if not specs:
        raise UserError(f"--jobs-dir: no *.yaml specs in {str(jobs_dir)!r}")
    out: dict[Path, str] = {}
    for path in specs:
        job = build_job(str(path), {}, environ={}, defer_account=True)
        target = path.with_suffix(job.cluster.script_suffix)
        out[target] = render_job(job, regenerate="hpc render --all-jobs", templates=templates,
                                 script=str(target))
    return out


# --- submitting ---------------------------------------------------------------------


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
    job: Job, runs_dir: Path, resume: str | None = None, regenerate: str | None = None,
    templates: str | None = None, environ: Mapping[str, str] | None = None,
    now: float | None = None, sweep: list[SweepTask] | None = None,
    max_parallel: int | None = None, chain: int = 1, after: After | None = None,
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
    from hpc.spec import submitting_python

    scheduler = job.scheduler
    runs.check_runs_dir(runs_dir)
    scheduler.check_runs_dir(runs_dir)
    now = time.time() if now is None else now
    record = None
    if resume:
        found = runs.find(resume, runs_dir)
        if found is None:
            raise UserError(f"resume: {resume!r} is not a run directory (no run.json); "
                            "allowed: a directory made by hpc submit, or its name under --runs-dir")
        run_dir, record = found
    else:
        run_dir = runs.free_run_dir(runs_dir, job.name, now)
    tasks, max_parallel = _sweep_tasks(run_dir, record, sweep, max_parallel)
    notes: list[str] = []
    if tasks:  # the queue's array limit (issue 32: Polaris prod takes 10 at once)
        from hpc.sweep import throttle

        q = job.cluster.queues.get(job.queue or "") if job.queue else None
        max_parallel, note = throttle(len(tasks), max_parallel, q.array_limit if q else None,
                                      f"the {job.cluster.name} queue {job.queue!r}")
        notes += [note] if note else []
    parts = _array_parts(job, len(tasks), notes) if tasks else []
    if tasks:
        from hpc.sweep import check_checkpoint_dirs

        check_checkpoint_dirs(job.spec.command, tasks, run_dir)
    if tasks:  # the first array's size: all tasks, or the first part of a split sweep
        job = replace(job, array_size=parts[0][1], max_parallel=max_parallel)
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
    return Plan(job=job, run_dir=run_dir, resume=bool(resume), script=script,
                text=render_job(job, regenerate, templates),
                argv=tuple(_submit_command(scheduler, str(script), after)),
                regenerate=regenerate, templates=templates, now=now, sweep=tuple(tasks),
                chain=chain, after=after, notes=tuple(notes),
                parts=tuple(parts) if len(parts) > 1 else ())


def _submit_command(scheduler: Scheduler, script: str, after: After | None) -> list[str]:
    """The submit command; ``after`` only when given, so a user's scheduler written before
    ``--after`` existed (``submit_command(self, script)``) still works."""
    return scheduler.submit_command(script, after) if after is not None else \
        scheduler.submit_command(script)


def _check_chain(job: Job, chain: int, after: After | None) -> int:
    """``--chain``/``--after`` against the scheduler and the queue's site rules (one
    line, exit 2, before anything is written or submitted)."""
    from hpc.chain import After, check_chain

    check_chain(chain)
    if chain > 1 and job.array_size:
        raise UserError("--chain: a sweep's tasks share one run directory, so one task's end "
                        "would end every task's chain; allowed: --chain or --sweep, not both")
    if chain > 1 or after is not None:
        job.scheduler.dependency(after or After("0", "any"))  # no dependencies: one line
        # the queue the job lands in, named or picked (Perlmutter's default QOS is debug)
        queue = job.cluster.queues.get(job.queue or "") if job.queue else None
        if queue is not None and queue.no_dependencies:
            raise UserError(f"--chain/--after: the {job.cluster.name} queue {queue.name!r} takes "
                            f"no job dependencies ({queue.no_dependencies}); allowed: another "
                            "queue, or one job")
        limit = queue.max_queued if queue is not None else None
        if limit is not None and chain > limit:
            raise UserError(f"--chain: {chain} segments; the {job.cluster.name} queue "
                            f"{queue.name!r} takes at most {limit} queued jobs per user; "
                            f"allowed: --chain 1 to {limit}")  # fmt: skip
    return chain


def _sweep_tasks(run_dir: Path, resumed: dict[str, Any] | None, sweep: list[SweepTask] | None,
                 max_parallel: int | None) -> tuple[list[SweepTask], int | None]:
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
            raise UserError("--sweep: the run directory holds a sweep already; allowed: "
                            "--resume alone (the same tasks again) or a new run")
        if max_parallel is not None:
            raise UserError("--max-parallel: the resumed sweep keeps its own; allowed: "
                            "--resume alone")
        return sweeps.read_sweep(run_dir)
    if resumed is not None and sweep:
        raise UserError(f"--sweep: {str(run_dir)!r} was not a sweep (no {sweeps.MANIFEST}), so "
                        "its tasks would have no overrides to read; allowed: --resume alone "
                        "(the same job again), or --sweep in a new run")  # fmt: skip
    tasks = list(sweep or [])
    shape = sorted({k for t in tasks for k in t.overrides if k in SPEC_KEYS})
    if shape:
        raise UserError(f"--sweep: {', '.join(shape)} is the job's own (every task of an array "
                        "gets the same allocation); allowed: trainer keys such as optim.lr, and "
                        "one hpc submit per size for a scaling table (the trainer scales lr by "
                        "its scaling.rule)")
    if sweep is not None and len(tasks) == 1:
        raise UserError("--sweep: one task; allowed: two or more values (a single value "
                        "is --set KEY=VALUE on the command)")
    if max_parallel is not None:
        if not tasks:
            raise UserError("--max-parallel: only with --sweep")
        sweeps.check_max_parallel(max_parallel, len(tasks))
    return tasks, max_parallel


def submit(plan: Plan, on_start: Callable[[str], None] | None = None) -> Submitted:
    """Create the run directory, write the script, spec and record, and submit.

    A name taken since the plan was made (another submission in the same second) gets
    the next free one, and the script is rendered again for it.
    """
    import yaml

    from hpc import runs

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
    git = runs.git_info()
    with runs.locked(run_dir):  # concurrent --resume calls: names and history stay whole
        previous = runs.read_record(run_dir) if plan.resume else None
        script = runs.create_free(run_dir, "job", job.cluster.script_suffix, text)
        runs.create_free(run_dir, "spec", ".yaml",
                         yaml.safe_dump(job.to_dict(), sort_keys=False, allow_unicode=True))
        if plan.sweep and not plan.resume:
            from hpc.sweep import write_manifest

            write_manifest(run_dir, list(plan.sweep), job.max_parallel)
        argv = scheduler.submit_command(str(script))
        record = runs.new_record(job, git, script=str(script), submit_command=shlex.join(argv))
        if job.spec.split_logs:  # hpc logs --err: the job's stderr has its own file
            record["split_logs"] = True
        if plan.sweep:  # a line per task: its index, overrides and folder
            record["sweep"] = [{"index": t.index, "label": t.label, "dir": t.dirname}
                               for t in plan.sweep]
        if previous is not None:  # earlier submissions of this run, oldest first
            earlier = previous.pop("submissions", [])
            record["submissions"] = [*earlier, previous]
        runs.write_record(run_dir, record)

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


def _array_parts(job: Job, n_tasks: int, notes: list[str]) -> list[tuple[int, int]]:
    """The arrays a sweep of ``n_tasks`` is submitted as: one, or (where the scheduler
    splits) one per ``MaxArraySize`` tasks read from the cluster now (issue 32)."""
    from hpc.sweep import split

    scheduler = job.scheduler
    limit = scheduler.array_size_limit() if scheduler.array_parts else None
    parts = split(n_tasks, limit)
    if min(count for _, count in parts) < scheduler.array_min_size:  # only at a limit of 2
        raise UserError(f"--sweep: {n_tasks} tasks in arrays of at most {limit} "
                        f"({scheduler.array_size_setting}) leave one array of "
                        f"{min(c for _, c in parts)} task, and {scheduler.name} takes no array "
                        f"of fewer than {scheduler.array_min_size}; allowed: a multiple of "
                        f"{limit} tasks")
    if len(parts) > 1:
        paced = (f", each after the one before (--max-parallel {job.max_parallel} holds for the "
                 "sweep)") if job.max_parallel else ""
        notes.append(f"hpc: {n_tasks} tasks exceed the cluster's array size ({limit}, "
                     f"{scheduler.array_size_setting}): one sweep of {len(parts)} arrays{paced}")
    return parts


def _submit_parts(plan: Plan, scheduler: Scheduler, script: str, run_dir: Path,
                  first: str) -> list[dict[str, Any]]:
    """Queue arrays 2..N of a split sweep. Each holds its own ``--after``; with a
    ``--max-parallel`` each waits for the one before (``afterany``), so no more than
    that many tasks of the sweep run at once. No half sweep: when a part is refused, the
    parts queued are cancelled and the one line says so (as for a chain)."""
    from hpc import runs
    from hpc.chain import After
    from hpc.errors import SchedulerError

    mp = plan.job.max_parallel
    done = [{"job_id": first, "offset": plan.parts[0][0], "count": plan.parts[0][1]}]
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
            message = (f"--sweep: array {k} of {len(plan.parts)} was refused ({exc}); cancelled "
                       f"the {len(done)} array(s) already queued ({ids}){note}")
            runs.update_submission(run_dir, script, error=message, state="CANCELLED",
                                   array_parts=done)
            raise SchedulerError(message) from exc
        done.append({"job_id": sub.job_id, "offset": offset, "count": count})
    return done


def _submit_chain(scheduler: Scheduler, count: int, script: str, run_dir: Path,
                  first: str) -> list[dict[str, Any]]:
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
            message = (f"--chain: segment {k} of {count} was refused ({exc}); cancelled the "
                       f"{len(ids)} segment(s) already queued ({', '.join(ids)}){note}")
            runs.update_submission(run_dir, script, error=message, state="CANCELLED",
                                   chain=[{"segment": i + 1, "job_id": j} for i, j in enumerate(ids)])
            raise SchedulerError(message) from exc
    return [{"segment": i + 1, "job_id": j} for i, j in enumerate(ids)]


def _moved(job: Job, old: Path, new: Path) -> Job:
    """The job with its run directory paths pointed at ``new`` instead of ``old``."""
    old_abs, new_abs = str(old.resolve()), str(new.resolve())
    env = {k: (new_abs if v == old_abs else v) for k, v in job.spec.env.items()}
    out = new_abs if job.spec.output_dir == old_abs else job.spec.output_dir
    return job.with_spec(env=env, output_dir=out)


# --- status and cancel ----------------------------------------------------------------


def locate(ident: str, runs_dir: Path, cluster: str | None = None
           ) -> tuple[str, Scheduler, dict[str, Any] | None]:
    """(job id, its scheduler, the run record if ``ident`` names a run) for status/cancel."""
    from hpc import runs, schedulers

    if not ident.strip() or any(c in ident for c in ", \t\n"):
        raise UserError(f"id: {ident!r}; allowed: one run directory, run name or job id")
    found = runs.find(ident, runs_dir, history=True)
    if found is not None:
        run_dir = found[0]
        rec = runs.job_entry(found[1], ident)  # an earlier job of a resumed run: that one
        if not rec.get("job_id"):
            raise UserError(f"id: {ident!r} names a run that has no job id (submit failed: "
                            f"{rec.get('error', 'unknown')})")
        scheduler = schedulers.get(str(rec["scheduler"]))
        job_id = str(rec["job_id"])
        if not scheduler.owns_id(job_id):  # a record is untrusted: checked like a typed id
            raise UserError(f"run: {str(run_dir / runs.RECORD)!r}: job_id {job_id!r} is not a "
                            f"{scheduler.name} job id; allowed: {scheduler.id_examples} (a "
                            "record written by hpc submit)")  # fmt: skip
        return job_id, scheduler, rec
    if cluster:
        from hpc import profiles as clusters

        scheduler = schedulers.get(clusters.load(cluster).scheduler)
    else:
        name = schedulers.detect()
        if name is None:
            raise UserError(f"id: {ident!r} is no run directory and no scheduler client is on "
                            "PATH; allowed: a run directory, or --cluster NAME")  # fmt: skip
        scheduler = schedulers.get(name)
    # The one gate before a typed id reaches a client (scancel, qdel, squeue): a typo, or
    # an id in other digits (١٢٣, １２３: str.isdigit and int() take them, no scheduler
    # gives them), is refused as not a job id instead of being sent on.
    if not scheduler.owns_id(ident):
        raise UserError(f"id: {ident!r} is neither a run under {str(runs_dir)!r} nor a "
                        f"{scheduler.name} job id; allowed: a run directory, its name, or a "
                        f"job id such as {scheduler.id_examples}")  # fmt: skip
    return ident, scheduler, None


def status(ident: str, runs_dir: Path, cluster: str | None = None) -> tuple[str, JobState]:
    """The job's id and state; a job that ran here to the end answers from its record."""
    job_id, state, _ = run_status(ident, runs_dir, cluster, tasks=False)
    return job_id, state


def run_status(ident: str, runs_dir: Path, cluster: str | None = None, tasks: bool = True
               ) -> tuple[str, JobState, list[tuple[str, str, JobState]]]:
    """(job id, its state, (task id, label, state) of each sweep task) in one batched
    scheduler query: ``hpc status`` of a 1,000-task sweep asks once, not 1,001 times
    (:meth:`~hpc.schedulers.Scheduler.statuses`). Tasks that run here one after
    another have no ids of their own: their state is the job's, from its record once
    it ended. ``tasks=False``: the job alone."""
    from hpc.schedulers import JobState

    job_id, scheduler, rec = locate(ident, runs_dir, cluster)
    chain = _chain_entries(ident, rec, scheduler) if tasks and rec is not None else []
    if chain:  # the segments of a chain, one query for all (hpc.chain)
        states = scheduler.statuses([job_id, *(j for j, _ in chain)])
        return job_id, states[job_id], [(j, label, states[j]) for j, label in chain]
    sweep = _sweep_entries(ident, rec) if tasks and rec is not None else []
    recorded = (rec or {}).get("state")
    if scheduler.runs_here and recorded not in (None, "RUNNING"):
        state = JobState(str(recorded))
        return job_id, state, [(job_id, label, state) for _, label in sweep]
    if scheduler.array_index_var is None:  # tasks are the job's, one after another
        state = scheduler.statuses([job_id])[job_id]
        return job_id, state, [(job_id, label, state) for _, label in sweep]
    parts = _parts_of(ident, rec, scheduler) if rec is not None else []
    if parts:  # one sweep of several arrays (MaxArraySize): still one query for all
        ids = {}
        for index, label in sweep:
            part = next((p for p in parts if p[1] <= index < p[1] + p[2]), None)
            if part is not None:
                ids[scheduler.task_id(part[0], index - part[1])] = label
        states = scheduler.statuses([*(p[0] for p in parts), *ids])
        state = combined_state([states[p[0]] for p in parts])
        return job_id, state, [(tid, label, states[tid]) for tid, label in ids.items()]
    ids = {scheduler.task_id(job_id, index): label for index, label in sweep}
    states = scheduler.statuses([job_id, *ids])
    return job_id, states[job_id], [(tid, label, states[tid]) for tid, label in ids.items()]


def _parts_of(ident: str, rec: dict[str, Any], scheduler: Scheduler
              ) -> list[tuple[str, int, int]]:
    """(job id, offset, count) of each array of a split sweep (``array_parts`` of the
    record, checked: the record is untrusted); [] for a sweep that is one array."""
    out = []
    for part in rec.get("array_parts") or []:
        job_id = str(part.get("job_id")) if isinstance(part, dict) else ""
        offset, count = (part.get("offset"), part.get("count")) if isinstance(part, dict) else (0, 0)
        if (not scheduler.owns_id(job_id) or type(offset) is not int or type(count) is not int
                or offset < 0 or count < 1):
            raise UserError(f"run: {ident!r}: run.json's array_parts entry {part!r} is not "
                            f"a {scheduler.name} job id with offset and count; allowed: a record "
                            "written by hpc submit --sweep")  # fmt: skip
        out.append((job_id, offset, count))
    return out


def combined_state(states: list[JobState]) -> JobState:
    """One state for a sweep of several arrays: running while any part runs, pending
    while any waits; once all ended, FAILED if any failed, else the first that did not
    complete, else COMPLETED."""
    from hpc.schedulers import JobState

    if len(set(states)) == 1:
        return states[0]
    for wanted in (JobState.RUNNING, JobState.PENDING):
        if wanted in states:
            return wanted
    waiting = [s for s in states if not s.ended]
    if waiting:
        return waiting[0]
    if JobState.FAILED in states:
        return JobState.FAILED
    return next((s for s in states if s != JobState.COMPLETED), JobState.COMPLETED)


def _chain_entries(ident: str, rec: dict[str, Any], scheduler: Scheduler
                   ) -> list[tuple[str, str]]:
    """(job id, "segment K/N") of each segment a chain's record lists (checked like a
    typed id: the record is untrusted)."""
    chain = rec.get("chain") or []
    out = []
    for k, seg in enumerate(chain, 1):
        job_id = str(seg.get("job_id")) if isinstance(seg, dict) else ""
        if not scheduler.owns_id(job_id):
            raise UserError(f"run: {ident!r}: run.json's chain entry {seg!r} has no "
                            f"{scheduler.name} job id; allowed: a record written by hpc submit "
                            "--chain")  # fmt: skip
        out.append((job_id, f"segment {k}/{len(chain)}"))
    return out


def _sweep_entries(ident: str, rec: dict[str, Any]) -> list[tuple[int, str]]:
    """(array index, label) of each task a sweep run's record lists (checked: the record
    is untrusted)."""
    out = []
    for task in rec.get("sweep") or []:
        index = task.get("index") if isinstance(task, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise UserError(f"run: {ident!r}: run.json's sweep entry {task!r} has no index; "
                            "allowed: a record written by hpc submit --sweep")
        out.append((index, str(task.get("label"))))
    return out


def watch(ident: str, runs_dir: Path, run_dir: Path | None = None
          ) -> tuple[Callable[[], JobState], float]:
    """(the job's state now, the longest interval to ask it at) for ``hpc logs -f``.

    The run is found once (not once a poll), and the scheduler is asked for this one
    job only; a job that runs here answers from its own record (re-read, one file).
    The interval is the cluster profile's ``poll_s`` (how often the site lets one
    user ask its scheduler; ``hpc.logs.Backoff`` grows towards it)."""
    from hpc import profiles as clusters
    from hpc import runs
    from hpc.cluster import Cluster
    from hpc.schedulers import JobState

    job_id, scheduler, rec = locate(ident, runs_dir)
    found = runs.find(ident, runs_dir, history=True) if rec is not None else None
    # the run of a sweep split into several arrays: it goes on while any of them does
    parts = [p[0] for p in _parts_of(ident, rec, scheduler)] if rec is not None else []
    if rec is None and run_dir is not None and (run_dir / runs.RECORD).is_file():
        rec = runs.read_record(run_dir)  # an array task's id: its run's record
    try:
        poll_s = clusters.load(str(rec["cluster"])).poll_s if rec and rec.get("cluster") else None
    except UserError:  # a profile gone since (a user's own): the default
        poll_s = None
    poll_s = Cluster.poll_s if poll_s is None else poll_s

    def state() -> JobState:
        if scheduler.runs_here and found is not None:
            entry = runs.job_entry(runs.read_record(found[0]), ident)
            if entry.get("state") not in (None, "RUNNING"):
                return JobState(str(entry["state"]))
        if parts:
            states = scheduler.statuses(parts)
            return combined_state([states[p] for p in parts])
        return scheduler.statuses([job_id])[job_id]

    return state, float(poll_s)


def exit_code(ident: str, runs_dir: Path) -> int | None:
    """The exit code of a job that ended: its record's (a job that ran here to the
    end), else its scheduler's; None when neither can say."""
    job_id, scheduler, rec = locate(ident, runs_dir)
    code = (rec or {}).get("exit_code")
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    return scheduler.exit_code(job_id)


def task_states(ident: str, runs_dir: Path) -> list[tuple[str, str, JobState]]:
    """(task id, label, state) of each task of a sweep run; empty for other runs (see
    :func:`run_status`, which asks for the job and its tasks in the same query)."""
    from hpc import runs

    found = runs.find(ident, runs_dir)
    rec = found[1] if found else {}
    if not rec.get("sweep") or not rec.get("job_id"):
        return []
    return run_status(ident, runs_dir)[2]


def cancel(ident: str, runs_dir: Path, cluster: str | None = None) -> str:
    """Ask the job's scheduler to end it; returns the job id."""
    job_id, scheduler, rec = locate(ident, runs_dir, cluster)
    parts = _parts_of(ident, rec, scheduler) if rec is not None else []
    for part_id in dict.fromkeys([job_id, *(p[0] for p in parts)]):  # a split sweep: all
        scheduler.cancel(part_id)
    return job_id
