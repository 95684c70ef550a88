"""Status, watch and cancel of a submitted job: a run directory, run name or job id in,
one batched scheduler query (a sweep's tasks, a chain's segments and a split sweep's
arrays with it). ``hpc.core`` re-exports these names: it is the library the CLI and
users call.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import UserError

if TYPE_CHECKING:
    from hpc.schedulers import JobState, Scheduler


def locate(
    ident: str, runs_dir: Path, cluster: str | None = None
) -> tuple[str, Scheduler, dict[str, Any] | None]:
    """(job id, its scheduler, the run record if ``ident`` names a run) for status/cancel."""
    return _locate(ident, runs_dir, cluster)[:3]


def _locate(
    ident: str, runs_dir: Path, cluster: str | None = None
) -> tuple[str, Scheduler, dict[str, Any] | None, Path | None]:
    """:func:`locate`, and the run directory where ``ident`` names a run."""
    from hpc import runs, schedulers

    if not ident.strip() or any(c in ident for c in ", \t\n"):
        raise UserError(f"id: {ident!r}; allowed: one run directory, run name or job id")
    found = runs.find(ident, runs_dir, history=True)
    if found is not None:
        run_dir = found[0]
        rec = runs.job_entry(found[1], ident)  # an earlier job of a resumed run: that one
        if not rec.get("job_id"):
            raise UserError(
                f"id: {ident!r} names a run that has no job id (submit failed: "
                f"{rec.get('error', 'unknown')})"
            )
        scheduler = schedulers.get(str(rec["scheduler"]))
        job_id = str(rec["job_id"])
        if not scheduler.owns_id(job_id):  # a record is untrusted: checked like a typed id
            raise UserError(
                f"run: {str(run_dir / runs.RECORD)!r}: job_id {job_id!r} is not a "
                f"{scheduler.name} job id; allowed: {scheduler.id_examples} (a "
                "record written by hpc submit)"
            )
        return job_id, scheduler, rec, run_dir
    if cluster:
        from hpc import profiles as clusters

        scheduler = schedulers.get(clusters.load(cluster).scheduler)
    else:
        name = schedulers.detect()
        if name is None:
            raise UserError(
                f"id: {ident!r} is no run directory and no scheduler client is on "
                "PATH; allowed: a run directory, or --cluster NAME"
            )
        scheduler = schedulers.get(name)
    # The one gate before a typed id reaches a client (scancel, qdel, squeue): a typo, or
    # an id in other digits (١٢٣, １２３: str.isdigit and int() take them, no scheduler
    # gives them), is refused as not a job id instead of being sent on.
    if not scheduler.owns_id(ident):
        raise UserError(
            f"id: {ident!r} is neither a run under {str(runs_dir)!r} nor a "
            f"{scheduler.name} job id; allowed: a run directory, its name, or a "
            f"job id such as {scheduler.id_examples}"
        )
    return ident, scheduler, None, None


def status(ident: str, runs_dir: Path, cluster: str | None = None) -> tuple[str, JobState]:
    """The job's id and state; a job that ran here to the end answers from its record."""
    job_id, state, _ = run_status(ident, runs_dir, cluster, tasks=False)
    return job_id, state


def run_status(
    ident: str, runs_dir: Path, cluster: str | None = None, tasks: bool = True
) -> tuple[str, JobState, list[tuple[str, str, JobState]]]:
    """(job id, its state, (task id, label, state) of each sweep task) in one batched
    scheduler query: ``hpc status`` of a 1,000-task sweep asks once, not 1,001 times
    (:meth:`~hpc.schedulers.Scheduler.statuses`). Tasks that run here one after
    another have no ids of their own: their state is the job's, from its record once
    it ended. ``tasks=False``: the job alone."""
    from hpc.schedulers import JobState

    job_id, scheduler, rec, run_dir = _locate(ident, runs_dir, cluster)
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
        if state == JobState.UNKNOWN and run_dir is not None and _api_job(rec):
            cancelled = job_id in (rec or {}).get("cancelled", [])
            state = scheduler.ended_state(run_dir, job_id, cancelled)
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


def _parts_of(ident: str, rec: dict[str, Any], scheduler: Scheduler) -> list[tuple[str, int, int]]:
    """(job id, offset, count) of each array of a split sweep (``array_parts`` of the
    record, checked: the record is untrusted); [] for a sweep that is one array."""
    out = []
    for part in rec.get("array_parts") or []:
        job_id = str(part.get("job_id")) if isinstance(part, dict) else ""
        offset, count = (
            (part.get("offset"), part.get("count")) if isinstance(part, dict) else (0, 0)
        )
        if (
            not scheduler.owns_id(job_id)
            or type(offset) is not int
            or type(count) is not int
            or offset < 0
            or count < 1
        ):
            raise UserError(
                f"run: {ident!r}: run.json's array_parts entry {part!r} is not "
                f"a {scheduler.name} job id with offset and count; allowed: a record "
                "written by hpc submit --sweep"
            )
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


def _chain_entries(ident: str, rec: dict[str, Any], scheduler: Scheduler) -> list[tuple[str, str]]:
    """(job id, "segment K/N") of each segment a chain's record lists (checked like a
    typed id: the record is untrusted)."""
    chain = rec.get("chain") or []
    out = []
    for k, seg in enumerate(chain, 1):
        job_id = str(seg.get("job_id")) if isinstance(seg, dict) else ""
        if not scheduler.owns_id(job_id):
            raise UserError(
                f"run: {ident!r}: run.json's chain entry {seg!r} has no "
                f"{scheduler.name} job id; allowed: a record written by hpc submit "
                "--chain"
            )
        out.append((job_id, f"segment {k}/{len(chain)}"))
    return out


def _sweep_entries(ident: str, rec: dict[str, Any]) -> list[tuple[int, str]]:
    """(array index, label) of each task a sweep run's record lists (checked: the record
    is untrusted)."""
    out = []
    for task in rec.get("sweep") or []:
        index = task.get("index") if isinstance(task, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise UserError(
                f"run: {ident!r}: run.json's sweep entry {task!r} has no index; "
                "allowed: a record written by hpc submit --sweep"
            )
        out.append((index, str(task.get("label"))))
    return out


def watch(
    ident: str, runs_dir: Path, run_dir: Path | None = None
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
    """The exit code of a job that ended, as a shell gives it (0-255): its record's (a
    job that ran here to the end), else its scheduler's; None when neither can say.

    The record is a file anyone may have edited: a code past 255 would reach the exit
    of ``hpc logs -f`` modulo 256 (256 is 0, a failed job "succeeding"), so it is no
    code; a negative one is Python's "killed by signal N", 128+N as a shell says it."""
    job_id, scheduler, rec = locate(ident, runs_dir)
    code = (rec or {}).get("exit_code")
    if isinstance(code, int) and not isinstance(code, bool):
        if 0 <= code <= 255:
            return code
        return 128 - code if -127 <= code < 0 else None
    return scheduler.exit_code(job_id)


def failure_summary(ident: str, runs_dir: Path) -> list[str]:
    """The failing rank of a FAILED run, its host and its last lines (:mod:`hpc.failure`),
    as ``hpc status`` prints them on stderr and ``hpc status --watch`` shows them before
    it exits: one function so the two can never tell different stories. Empty when
    ``ident`` names no run (a bare job id has no logs here) or no rank can be named."""
    from hpc import failure, runs
    from hpc.logs_find import locate as log_locate

    found = runs.find(ident, runs_dir, history=True)
    if found is None:
        return []
    job = log_locate(ident, runs_dir)[1]  # an earlier job of a resumed run: its own log
    return failure.failing_rank_lines(found[0], found[1], job)


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
    job_id, scheduler, rec, run_dir = _locate(ident, runs_dir, cluster)
    parts = _parts_of(ident, rec, scheduler) if rec is not None else []
    for part_id in dict.fromkeys([job_id, *(p[0] for p in parts)]):  # a split sweep: all
        scheduler.cancel(part_id)
    if run_dir is not None and scheduler.runs_here and _api_job(rec):
        from hpc import runs

        runs.add_cancelled(run_dir, job_id)  # nothing else keeps it: Scheduler.ended_state
    return job_id


def _api_job(rec: dict[str, Any] | None) -> bool:
    """Whether ``rec`` is a job ``hpc.executor`` submitted (submitit's files in its run
    directory; no ``hpc run`` waits to record its exit code)."""
    return rec is not None and "executor" in rec
