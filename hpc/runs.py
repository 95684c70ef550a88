"""Run directories: every submission leaves one, and none is ever overwritten.

``runs/NAME-YYYYmmdd-HHMMSS/`` holds the rendered script, the resolved spec
(``spec.yaml``), and ``run.json`` with the submit command, scheduler, job id, git
commit and dirty flag. A name that exists already gets ``-2``, ``-3``, ...

A run is found by job id through the index beside the runs (``runs/.index/jobs``,
:mod:`hpc.runs_index`) without reading every record.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpc._util import read_regular, write_atomic
from hpc.errors import UserError
from hpc.runs_index import (
    _entries,
    _has_index_dir,
    _index_append,
    _index_lines,
    _index_locked,
    _job_ids,
    _read_index,
    _rebuild_index,
    index_key,
)
from hpc_ddp.run_layout import RUN_RECORD

RECORD = RUN_RECORD
LOCK = ".lock"


def check_runs_dir(runs_dir: Path) -> Path:
    """``runs_dir`` resolved, or one line when it cannot be a folder of runs.

    Resolving is where a symlink loop shows (``RuntimeError`` before Python 3.13,
    ``OSError`` ELOOP after), so every caller that makes or names a run directory
    passes ``--runs-dir`` through here first.
    """
    try:
        resolved = runs_dir.resolve()
    except (OSError, RuntimeError):
        raise UserError(
            f"--runs-dir: {str(runs_dir)!r} is a symlink loop (or a link "
            "chain too long to follow); allowed: a folder"
        ) from None
    if resolved.exists() and not resolved.is_dir():
        raise UserError(f"--runs-dir: {str(runs_dir)!r} is not a folder; allowed: a folder")
    return resolved


def _run_dirs(runs_dir: Path, name: str, now: float | None) -> Iterator[Path]:
    """``NAME-YYYYmmdd-HHMMSS``, then ``-2``, ``-3``, ... (the candidates, in order)."""
    base = f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    for i in range(1, 1000):
        yield runs_dir / (base if i == 1 else f"{base}-{i}")


def free_run_dir(runs_dir: Path, name: str, now: float | None = None) -> Path:
    """The directory :func:`new_run_dir` would create now (for a dry run: nothing is made)."""
    for path in _run_dirs(runs_dir, name, now):
        if not path.exists():
            return path
    raise UserError(f"runs-dir: too many runs named {name!r} in {str(runs_dir)!r}")


def new_run_dir(runs_dir: Path, name: str, now: float | None = None) -> Path:
    """Create a fresh directory (``os.mkdir`` is atomic: two submissions never share one)."""
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"runs-dir: cannot create {str(runs_dir)!r}: {exc.strerror}") from None
    for path in _run_dirs(runs_dir, name, now):
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise UserError(f"runs-dir: cannot create {str(path)!r}: {exc.strerror}") from None
        if _has_index_dir(runs_dir):
            _index_append(runs_dir, [], stamp=True)  # the index still knows all of runs/
        return path
    raise UserError(f"runs-dir: too many runs named {name!r} in {str(runs_dir)!r}")


def free_name(run_dir: Path, stem: str, suffix: str) -> Path:
    """The name :func:`create_free` would take now (nothing is created)."""
    for i in range(1, 1000):
        path = run_dir / (f"{stem}{suffix}" if i == 1 else f"{stem}-{i}{suffix}")
        if not path.exists():
            return path
    raise UserError(f"resume: too many submissions in {str(run_dir)!r}")


def create_free(run_dir: Path, stem: str, suffix: str, text: str = "") -> Path:
    """Create ``stem+suffix`` (or ``stem-2+suffix``, ...) holding ``text``; never overwrite.

    ``O_EXCL`` makes the choice of name and the creation one step, so two concurrent
    ``--resume`` submissions into one run directory can never take the same name.
    """
    for i in range(1, 1000):
        path = run_dir / (f"{stem}{suffix}" if i == 1 else f"{stem}-{i}{suffix}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        except OSError as exc:
            raise UserError(
                f"run directory {str(run_dir)!r}: cannot write: {exc.strerror}"
            ) from None
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        return path
    raise UserError(f"resume: too many submissions in {str(run_dir)!r}")


def git_info(cwd: Path | None = None) -> dict[str, Any]:
    """The commit and whether the tree is dirty; empty when not in a git repository.

    Decoded with replacement: with ``core.quotepath=false`` git prints file names as
    their raw bytes, and one in Latin-1 must not stop ``hpc submit`` with a traceback.
    """
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            timeout=10,
            encoding="utf-8",
            errors="replace",
        )
        if head.returncode != 0:
            return {"git_commit": None, "git_dirty": None}
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            timeout=10,
            encoding="utf-8",
            errors="replace",
        )
        return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return {"git_commit": None, "git_dirty": None}


@contextlib.contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir/.lock`` (flock) around a read-modify-write of the record: the lock
    both sides take (:func:`hpc_ddp.files.acquire_lock`, the supervisor's too), which never
    follows a planted link, never blocks on a FIFO and locks only a regular file."""
    from hpc_ddp.files import NotLockable, acquire_lock

    path = run_dir / LOCK
    try:
        fd = acquire_lock(path)
    except NotLockable:
        raise UserError(
            f"run: {str(path)!r} is not a regular file; allowed: a regular "
            "file (as hpc submit makes it)"
        ) from None
    except OSError as exc:
        kind = "a symbolic link" if path.is_symlink() else exc.strerror
        raise UserError(
            f"run: cannot lock {str(path)!r}: {kind}; allowed: a regular file "
            "(as hpc submit makes it)"
        ) from None
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Write ``run.json`` atomically (mkstemp + rename) so a reader never sees half of it,
    and its job ids into the index beside it in the same step: under the index lock, so
    a rebuild sees both or neither, and the index line first, so a write cut short
    leaves a line whose record lacks the id (found stale and rebuilt), never a record
    the index misses."""
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    lines = _index_lines(run_dir.name, record)
    if not lines:
        write_atomic(run_dir / RECORD, text, "run directory")
        return
    if not _has_index_dir(run_dir.parent):  # no index (yet): made by the first lookup
        write_atomic(run_dir / RECORD, text, "run directory")
        if _has_index_dir(run_dir.parent):  # a rebuild began meanwhile: maybe before
            _index_append(run_dir.parent, lines)  # our write, so add it (after the swap)
        return
    with _index_locked(run_dir.parent) as held:
        if held:
            _index_append(run_dir.parent, lines, locked=True)
        write_atomic(run_dir / RECORD, text, "run directory")


def new_record(job: Any, git: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The ``run.json`` of a new submission of ``job`` (a resolved ``hpc.job.Job``).

    The one place both ``hpc submit`` (adding its script and submit command) and
    ``hpc.executor`` (adding its submitit executor, folder and job ids) make a record,
    so ``hpc status``/``logs``/``cancel`` read the same keys from either. ``git`` is
    :func:`git_info`'s answer, asked by the caller before it takes the run's lock.
    """
    record: dict[str, Any] = {
        "name": job.name,
        "cluster": job.cluster.name,
        "scheduler": job.scheduler.name,
        "spec": job.spec.source,
        "cwd": os.getcwd(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "job_id": None,
    }
    return {**record, **fields, **git}


def add_job_ids(run_dir: Path, job_ids: list[str]) -> None:
    """Append ids a Python API executor submitted to ``run.json`` (``job_id``: the
    latest, what ``hpc status RUN`` asks), under the run's lock. A record that is gone
    or damaged is left alone: the jobs were submitted, only the note is lost."""
    if not job_ids:
        return
    with locked(run_dir):
        try:
            record = read_record(run_dir)
        except UserError:
            return
        record["job_ids"] = [*record.get("job_ids", []), *job_ids]
        record["job_id"] = job_ids[-1]
        write_record(run_dir, record)


def add_cancelled(run_dir: Path, job_id: str) -> None:
    """Note in ``run.json`` that ``hpc cancel`` stopped ``job_id`` (an ``hpc.executor``
    local job: nothing else records how it ended), under the run's lock; a record
    that is gone or damaged is left alone, as in :func:`add_job_ids`."""
    with locked(run_dir):
        try:
            record = read_record(run_dir)
        except UserError:
            return
        if job_id not in record.get("cancelled", []):
            record["cancelled"] = [*record.get("cancelled", []), job_id]
            write_record(run_dir, record)


def update_submission(run_dir: Path, script: str, **changes: Any) -> None:
    """Apply ``changes`` to the submission of ``script``, under the lock.

    A later ``--resume`` may already have moved that submission into the record's
    ``submissions`` history, so it is found by its script, wherever it is now.
    """
    with locked(run_dir):
        record = read_record(run_dir)
        for entry in [record, *record.get("submissions", [])]:
            if isinstance(entry, dict) and entry.get("script") == script:
                entry.update(changes)
                break
        write_record(run_dir, record)


def read_record(run_dir: Path) -> dict[str, Any]:
    """The record of a run directory; a damaged one is one line naming the file."""
    return _load(run_dir / RECORD)


def _load(path: Path) -> dict[str, Any]:
    """Parse and check one ``run.json`` (untrusted: anyone may have edited it).

    ``RecursionError``: valid JSON nested deeper than the parser's stack (``[[[...]]]``).
    """
    text = read_regular(path, "run")  # never a FIFO's hang nor /dev/zero's endless read
    try:
        data = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"run: {str(path)!r} is not readable JSON ({reason})") from None
    if not isinstance(data, dict):
        raise UserError(
            f"run: {str(path)!r} is not a run record (a JSON object with "
            "scheduler and job_id); it was damaged or written by hand"
        )
    _check_record(data, path)
    return data


def _check_record(record: dict[str, Any], path: Path) -> None:
    """Refuse fields whose type the readers rely on (status, logs, task states), so a
    hand-edited record is one line here instead of a traceback where it is used."""
    from hpc.schedulers import STATES

    where = f"run: {str(path)!r}"
    for key in ("submissions", "sweep", "chain", "cancelled"):
        if not isinstance(record.get(key, []), list):
            raise UserError(
                f"{where}: {key} is a {type(record[key]).__name__}; allowed: a list "
                "(a record written by hpc submit)"
            )
    for pos, entry in enumerate([*record.get("submissions", []), record]):
        at = f"{where}: submission {pos}" if entry is not record else where
        if not isinstance(entry, dict):
            raise UserError(f"{at} is a {type(entry).__name__}; allowed: a JSON object")
        scheduler, job_id, state = entry.get("scheduler"), entry.get("job_id"), entry.get("state")
        if not isinstance(scheduler, str) or not scheduler:
            raise UserError(f"{at}: scheduler {scheduler!r}; allowed: a scheduler's name")
        if job_id is not None and (
            not isinstance(job_id, str) or not job_id or not job_id.isprintable() or " " in job_id
        ):
            raise UserError(
                f"{at}: job_id {job_id!r}; allowed: null or the job id its "
                "scheduler gave (printable text, no spaces)"
            )
        if state is not None and state not in STATES:
            raise UserError(f"{at}: state {state!r}; allowed: null or one of {', '.join(STATES)}")
    for task in record.get("sweep", []):  # hpc status prints each task's label
        label = task.get("label") if isinstance(task, dict) else None
        if not isinstance(label, str) or not label.isprintable():
            raise UserError(
                f"{where}: sweep entry {task!r} has no printable label; allowed: a "
                "record written by hpc submit --sweep"
            )


def _record_or_none(path: Path) -> Any:
    """A record parsed, None when it is missing or damaged (another run's problem must
    not hide the run asked for: a FIFO, binary, or JSON nested past the parser)."""
    try:
        return json.loads(read_regular(path, "run").decode("utf-8"))
    except (UserError, ValueError, RecursionError):
        return None


def find(ident: str, runs_dir: Path, history: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """A run directory given by path, by name under ``runs_dir``, or by its job id;
    ``history``: also by the id of an earlier submission (``--resume``) of the run.

    By job id the index (see the module docstring) names the run: one record is read,
    whatever the number of runs."""
    if not ident.strip():
        raise UserError("id: empty; allowed: a run directory, its name, or a job id")
    for candidate in (Path(ident), runs_dir / ident):
        try:
            is_run = (candidate / RECORD).is_file()
        except OSError:  # a name too long for a path: no run, maybe a job id
            is_run = False
        if is_run:
            return candidate, read_record(candidate)
    if not runs_dir.is_dir():
        return None
    key = index_key(ident)
    index = _read_index(runs_dir, key)
    for attempt in range(2):
        if index is None:  # missing or damaged: rebuilt (or, read-only, read in memory)
            index = _rebuild_index(runs_dir)
        stale = False
        for name in sorted(index.runs.get(key, ()), reverse=True):  # newest name first
            rec = _record_or_none(runs_dir / name / RECORD)
            entries = _entries(rec)
            if not any(index_key(j) == key for e in entries for j in _job_ids(e)):
                stale = True  # the record is gone, damaged, or no longer holds the id
                continue
            if any(_has_id(e, ident) for e in (entries if history else entries[-1:])):
                _check_record(rec, runs_dir / name / RECORD)  # the one asked for: checked
                return runs_dir / name, rec
        if (
            attempt == 0
            and not index.rebuilt
            and (stale or index.damaged or index.older_than(runs_dir))
        ):
            index = None
            continue
        return None
    return None


def job_entry(record: dict[str, Any], ident: str) -> dict[str, Any]:
    """The entry of ``record`` (itself or an earlier submission) whose job ``ident`` is;
    the record itself, its latest job, when ``ident`` names the run rather than a job."""
    earlier = record.get("submissions")
    entry: dict[str, Any]
    for entry in [record, *reversed(earlier if isinstance(earlier, list) else [])]:
        if _has_id(entry, ident):
            return entry
    return record


def _has_id(entry: Any, ident: str) -> bool:
    """Whether a record's entry is the job ``ident`` (or holds it, one array of a split
    sweep)."""
    if not isinstance(entry, dict):
        return False
    return any(_is_id(job_id, ident) for job_id in _job_ids(entry))


def _is_id(job_id: str, ident: str) -> bool:
    """Whether ``job_id`` is the job ``ident``: the same id, its number alone
    (PBS ``123`` of ``123.server``), or another spelling of the same server (qsub
    prints ``123.host.domain``, qstat and users may say ``123.host``)."""
    if job_id == ident or job_id.split(".")[0] == ident:
        return True
    number, _, server = job_id.partition(".")
    asked_number, _, asked = ident.partition(".")
    return (
        number == asked_number
        and bool(server)
        and bool(asked)
        and (server.startswith(asked + ".") or asked.startswith(server + "."))
    )
