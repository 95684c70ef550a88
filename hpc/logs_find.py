"""Which file is a job's log: ``hpc logs RUN_DIR|JOB_ID`` finds it here (:mod:`hpc.logs` prints it).

Each scheduler names the log itself, from the directives that ``hpc submit`` renders
into the run directory; what the names look like is the scheduler's own
(``Scheduler.log_patterns``, ``log_name``, ``split_id`` in ``hpc.schedulers.NAME``), so
a new scheduler's logs are found without a change here:

- SLURM: ``--output=RUN_DIR/%x-%j.out`` -> ``NAME-JOBID.out``; an array's task logs are
  ``NAME-ARRAYID_TASK.out`` (``%x-%A_%a.out``: ``%j`` of a task is an unrelated id);
- PBS: ``-o RUN_DIR/`` (a folder) -> ``JOBID.OU`` (``123.server.OU``; array subjobs
  ``123[4].server.OU``); without ``-o`` PBS writes ``NAME.oJOBNUM`` in the submit folder;
- local: ``output.log``, then ``output-2.log`` ... for each ``--resume`` (no id in the
  name: matched to the run record's submissions in order).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from hpc.errors import UserError

if TYPE_CHECKING:
    from hpc.schedulers import Scheduler


class _Log(NamedTuple):
    path: Path
    scheduler: str
    key: tuple[str, str | None] | None  # (job number, task); None: no id in the name
    seq: int  # no id in the name: 1 for the run's first log, N for its Nth


def _schedulers() -> list[Scheduler]:
    from hpc import schedulers

    return [schedulers.get(name) for name in schedulers.names()]


def job_key(job: str, known: list[Scheduler] | None = None) -> tuple[str, str | None] | None:
    """``(number, task)`` of a job id of any scheduler (SLURM ``12345_3``, PBS
    ``123[3].server``); None for anything else. ``known``: the schedulers, when the
    caller has listed them already (listing reads the package folder)."""
    for scheduler in _schedulers() if known is None else known:
        key = scheduler.split_id(job.strip())
        if key is not None:
            return key
    return None


def _scan(run_dir: Path, known: list[Scheduler]) -> list[_Log]:
    found = []
    try:
        entries = sorted(run_dir.iterdir())
    except OSError as exc:
        raise UserError(f"logs: cannot list {str(run_dir)!r}: {exc.strerror}") from None
    patterns = [(s, regex) for s in known for regex in s.log_patterns]
    for path in entries:
        for scheduler, regex in patterns:
            match = re.fullmatch(regex, path.name)
            if match is None or not path.is_file():
                continue
            job = match.groupdict().get("job")
            if job is None:
                found.append(_Log(path, scheduler.name, None, int(match.group("seq") or 1)))
            else:
                found.append(_Log(path, scheduler.name, scheduler.split_id(job), 0))
            break
    return found


def _submissions(run_dir: Path) -> list[dict[str, Any]]:
    """The run's submissions, oldest first ([] when there is no record)."""
    from hpc import runs

    if not (run_dir / runs.RECORD).is_file():
        return []
    record = runs.read_record(run_dir)
    earlier = record.get("submissions", [])
    subs = [s for s in earlier if isinstance(s, dict)] if isinstance(earlier, list) else []
    return [*subs, record]


def _latest(logs: list[_Log]) -> Path:
    """The most recently written; ties (same mtime) go to the higher array task."""

    def order(log: _Log) -> tuple[float, int]:
        try:
            mtime = log.path.stat().st_mtime
        except OSError:
            mtime = 0.0
        task = log.key[1] if log.key else None
        return mtime, int(task) if task else log.seq

    return max(logs, key=order).path


def find_log(run_dir: Path, job: str | None = None) -> Path:
    """The log of ``job`` (a job id of this run, an array task's ``12345_3`` or
    ``123[3].server``, or a local ``local-PID-START``), else of the run's latest job.

    For an array without a task the most recently written task log is returned. A
    job that has not started yet has no log: the path its scheduler will write is
    returned (``Scheduler.log_name`` and the run record) so that :func:`follow` can
    wait for it. Anything not found is one line naming what the run has.
    """
    if not run_dir.is_dir():
        raise UserError(f"logs: {str(run_dir)!r} is not a directory; allowed: a run directory")
    known = _schedulers()
    logs = _scan(run_dir, known)
    subs = _submissions(run_dir)
    if job is not None and not job.strip():
        raise UserError("logs: empty job id; allowed: a job id of this run, or none for the latest")
    wanted = job.strip() if job else None
    if wanted is None and subs and subs[-1].get("job_id"):
        wanted = str(subs[-1]["job_id"])
    if wanted is None:  # no record (a folder of logs): the newest log there
        if not logs:
            raise UserError(f"logs: no log file in {str(run_dir)!r} and no run record naming a job")
        return _latest(logs)

    key = job_key(wanted, known)
    if key is not None:
        matches = [g for g in logs if g.key and g.key[0] == key[0] and key[1] in (None, g.key[1])]
        if matches:
            return _latest(matches)

    def same(sub: dict[str, Any]) -> bool:
        recorded = str(sub.get("job_id") or "")
        return recorded == wanted or (
            key is not None and (job_key(recorded, known) or ("",))[0] == key[0]
        )

    sub = next((s for s in reversed(subs) if same(s)), None)
    if sub is None:
        if not any(s.owns_id(wanted) for s in known):
            examples = ", ".join(s.id_examples for s in known if s.id_examples)
            raise UserError(f"logs: {wanted!r} is not a job id; allowed: e.g. {examples}")
        if subs:
            raise UserError(
                f"logs: job {wanted!r} is not a job of {str(run_dir)!r}; its jobs: {_ids(subs)}"
            )
        raise UserError(f"logs: no log of job {wanted!r} in {str(run_dir)!r}")
    return run_dir / _expected_name(sub, subs, key, is_array=(run_dir / "sweep.json").is_file())


def err_log(run_dir: Path, out: Path) -> Path:
    """The stderr log beside the job log ``out`` (found by :func:`find_log`), for a job
    submitted with ``split_logs: true`` (its run record says so) or whose stderr file is
    there already; any other job's stderr is inside ``out``: one line saying so."""
    subs = _submissions(run_dir)
    split = bool(subs and subs[-1].get("split_logs"))
    for scheduler in _schedulers():
        if not any(re.fullmatch(regex, out.name) for regex in scheduler.log_patterns):
            continue
        name = scheduler.err_log_name(out.name)
        if name is not None and (split or (out.parent / name).is_file()):
            return out.parent / name
        break
    raise UserError(
        f"logs: {out.name!r} holds the job's stdout and stderr together; allowed: "
        "--err for a job submitted with split_logs: true (SLURM or PBS)"
    )


def _expected_name(
    sub: dict[str, Any],
    subs: list[dict[str, Any]],
    key: tuple[str, str | None] | None,
    is_array: bool,
) -> str:
    """The log name a submitted job's scheduler will write (it has not started yet)."""
    from hpc import schedulers

    name = str(sub.get("scheduler"))
    job_id = str(sub.get("job_id"))
    try:
        scheduler = schedulers.get(name)
    except UserError:
        scheduler = None
    task = key[1] if key is not None and key[1] is not None else ("0" if is_array else None)
    seq = 1 + [s for s in subs if s.get("scheduler") == name].index(sub)
    log = (
        scheduler.log_name(str(sub.get("name") or "job"), job_id, task, seq) if scheduler else None
    )
    if log is None:
        raise UserError(
            f"logs: job {job_id!r} ran on {name!r}, whose logs hpc cannot name; "
            f"allowed: runs of {', '.join(schedulers.names())}"
        )
    if os.path.basename(log) != log or log in (".", ".."):  # the name came from run.json
        raise UserError(
            f"logs: the record's job name makes the log name {log!r}, which is not "
            "a file in the run directory; allowed: a name without '/'"
        )
    return log


def _ids(subs: list[dict[str, Any]]) -> str:
    return ", ".join(str(s.get("job_id")) for s in subs if s.get("job_id")) or "none"


def locate(ident: str, runs_dir: Path) -> tuple[Path, str | None]:
    """``(run directory, job)`` for ``hpc logs IDENT``: a run directory or its name (job
    None: the latest), or a job id, an array task's included (``12345_3``, ``123[3].server``)."""
    from hpc import runs

    found = runs.find(ident, runs_dir, history=True)  # a resumed run's earlier jobs too
    if found is not None:
        run_dir, record = found
        is_job = ident.strip() not in (str(run_dir), run_dir.name) and not Path(ident).is_dir()
        return run_dir, (ident.strip() if is_job and record.get("job_id") else None)
    known = _schedulers()
    key = job_key(ident, known)
    if key is not None and key[1] is not None:  # a task: find the array's run by its number
        with contextlib.suppress(UserError):
            for candidate in (key[0], *(s.array_of(ident.strip()) for s in known)):
                found = runs.find(candidate, runs_dir, history=True) if candidate else None
                if found is not None:
                    return found[0], ident.strip()
    raise UserError(
        f"logs: {ident!r} is neither a run directory nor a job id of a run under {str(runs_dir)!r}"
    )
