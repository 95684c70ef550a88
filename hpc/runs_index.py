"""The job-id index beside the run directories (``hpc.runs``): a run found by its id.

``runs/.index/jobs`` finds a run by job id without reading every record (``hpc
status 12345`` among 10,000 runs reads one): a line ``"KEY"<TAB>"RUN"`` per job id of
each record (KEY is the id without a PBS server name, so every spelling of it finds
the run), appended under ``runs/.index/lock`` with each record write, and a line
``@NS`` for the mtime of ``runs/`` when the index last knew all of it (the index has
a folder of its own so that writing it leaves that mtime alone). It is a cache, never
trusted: a hit is checked against the record it names, a name is one folder of
``runs/`` only, and an index that is missing, damaged, names a record that no longer
holds the id, or is older than ``runs/`` on a miss, is rebuilt from the records.

The run records themselves (``run.json``: written, read, checked) are :mod:`hpc.runs`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpc._util import read_regular, write_atomic
from hpc.errors import UserError

INDEX_DIR = ".index"
INDEX = "jobs"
INDEX_LOCK = "lock"


def index_key(job_id: str) -> str:
    """How the index files a job id: without a PBS server name (``123`` of
    ``123.host.domain``, ``123[]`` of ``123[].host``), so each spelling finds it."""
    return job_id.split(".")[0]


class _Index:
    """What an index says: run names per key, and the mtime of ``runs/`` it knew."""

    def __init__(
        self, runs: dict[str, list[str]], stamp: int, rebuilt: bool = False, damaged: bool = False
    ) -> None:
        self.runs = runs
        self.stamp = stamp
        self.rebuilt = rebuilt
        self.damaged = damaged

    def older_than(self, runs_dir: Path) -> bool:
        """Whether ``runs/`` changed since (a run copied in or removed, or made by an
        older hpc): its mtime is not the one the index last recorded."""
        try:
            return os.stat(runs_dir).st_mtime_ns != self.stamp
        except OSError:
            return True


def _entries(record: Any) -> list[dict[str, Any]]:
    """A record's earlier submissions then itself (its entries that are objects)."""
    if not isinstance(record, dict):
        return []
    earlier = record.get("submissions")
    return [
        e for e in [*(earlier if isinstance(earlier, list) else []), record] if isinstance(e, dict)
    ]


def _index_lines(name: str, record: Any) -> list[str]:
    """The index lines of run ``name``: one per distinct key of its job ids."""
    keys = dict.fromkeys(index_key(j) for e in _entries(record) for j in _job_ids(e))
    run = json.dumps(name)
    return [f"{json.dumps(key)}\t{run}\n" for key in keys]


def _read_index(runs_dir: Path, key: str | None = None) -> _Index | None:
    """The index of ``runs_dir`` (with ``key``: its lines for that key only, the rest
    looked at, not parsed); None when it is missing or not a readable file.

    Untrusted like every file here: read as a regular file, bounded; a line that does
    not parse is skipped (and marks the index damaged), and a run name that is not one
    plain folder name (``..``, ``a/b``) is never followed."""
    path = runs_dir / INDEX_DIR / INDEX
    if os.path.islink(path.parent) or os.path.islink(path):  # hpc's own, never a link
        return None
    try:
        text = read_regular(path, "runs index").decode("utf-8", errors="replace")
    except UserError:
        return None
    runs: dict[str, list[str]] = {}
    stamp, damaged = -1, False
    prefix = None if key is None else json.dumps(key) + "\t"
    for line in text.split("\n"):
        if not line:
            continue
        if line.startswith("@") and line[1:].isascii() and line[1:].isdigit() and len(line) < 21:
            stamp = int(line[1:])
            continue
        if prefix is not None and not line.startswith(prefix):
            damaged = damaged or not line.startswith('"')  # no line of hpc's starts so
            continue
        key, tab, name = line.partition("\t")
        try:
            key, name = json.loads(key), json.loads(name)
        except (ValueError, RecursionError):
            damaged = True
            continue
        if not tab or not isinstance(key, str) or not _plain_name(name):
            damaged = True  # hpc never writes such a line: do not trust what is left
            continue
        names = runs.setdefault(key, [])
        if name not in names:
            names.append(name)
    return _Index(runs, stamp, damaged=damaged)


def _plain_name(name: Any) -> bool:
    """A run's folder name as the index may hold it: one path component under runs/."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\0" not in name
    )


def _rebuild_index(runs_dir: Path) -> _Index:
    """Read every record once and write the index anew (atomically); the index as read.

    Under the index lock, so no record write happens between the scan and the swap.
    Where ``runs/`` is read-only the index is only held in memory for this lookup."""
    from hpc.runs import RECORD, _record_or_none  # the records' reader (hpc.runs imports this)

    with _index_locked(runs_dir) as held:
        try:
            stamp = os.stat(runs_dir).st_mtime_ns  # before the scan: a later change is newer
        except OSError:
            stamp = -1
        runs: dict[str, list[str]] = {}
        lines = [f"@{stamp}\n"]
        for rec_path in sorted(runs_dir.glob(f"*/{RECORD}")):
            name = rec_path.parent.name
            for line in _index_lines(name, _record_or_none(rec_path)):
                lines.append(line)
                runs.setdefault(json.loads(line.partition("\t")[0]), []).append(name)
        if held:
            path = runs_dir / INDEX_DIR / INDEX
            with contextlib.suppress(OSError):
                if os.path.lexists(path) and not path.is_file() or os.path.islink(path):
                    os.unlink(path)  # a FIFO or a link planted where the index goes
            with contextlib.suppress(UserError):
                write_atomic(path, "".join(lines), "runs index")
    return _Index(runs, stamp, rebuilt=True)


def _has_index_dir(runs_dir: Path) -> bool:
    """Whether ``runs_dir`` has an index folder (made by the first lookup by job id, so
    that ``runs/`` holds nothing but runs until an index serves)."""
    import stat

    try:
        return stat.S_ISDIR(os.lstat(runs_dir / INDEX_DIR).st_mode)
    except OSError:
        return False


def _index_dir(runs_dir: Path) -> Path | None:
    """``runs_dir/.index``, made if missing; None where it cannot be (a read-only
    ``runs/``). Something else planted under that name (a link elsewhere, a file) is
    removed first: the name is hpc's own."""
    import stat

    folder = runs_dir / INDEX_DIR
    for _ in range(2):
        try:
            if stat.S_ISDIR(os.lstat(folder).st_mode):
                return folder
            os.unlink(folder)
        except FileNotFoundError:
            pass
        except OSError:
            return None
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
        except OSError:
            return None
    return None


@contextlib.contextmanager
def _index_locked(runs_dir: Path) -> Iterator[bool]:
    """Hold ``runs_dir/.index/lock`` (:func:`hpc_ddp.files.acquire_lock`); yields False
    when it cannot be had (a read-only ``runs/``, a planted FIFO or link): then the index
    is left alone and the next lookup that misses rebuilds it."""
    from hpc_ddp.files import acquire_lock

    folder = _index_dir(runs_dir)
    try:
        if folder is None:
            raise OSError("no index folder")
        fd = acquire_lock(folder / INDEX_LOCK)
    except OSError:
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)  # releases the lock


def _index_append(
    runs_dir: Path, lines: list[str], stamp: bool = False, locked: bool = False
) -> None:
    """Append ``lines`` (and with ``stamp`` the mtime of ``runs/`` now) to an index that
    exists; one that cannot be appended to is removed, to be rebuilt when next needed
    (an index that silently missed a record would hide that run)."""
    if not locked:
        with _index_locked(runs_dir) as held:
            if held:
                _index_append(runs_dir, lines, stamp, locked=True)
        return
    import stat

    path = runs_dir / INDEX_DIR / INDEX
    if not os.path.lexists(path):
        return  # no index yet: the first lookup builds it from the records
    if stamp:
        try:
            lines = [*lines, f"@{os.stat(runs_dir).st_mtime_ns}\n"]
        except OSError:
            return
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError("not a regular file")
            os.write(fd, "".join(lines).encode("utf-8"))
        finally:
            os.close(fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _job_ids(entry: dict[str, Any]) -> list[str]:
    """The job ids of one submission: its job, and the other arrays of a sweep split by
    the cluster's array size (``array_parts``, hpc.submit_many), so each part's id finds the run."""
    ids = [entry.get("job_id")]
    parts = entry.get("array_parts")
    if isinstance(parts, list):
        ids += [p.get("job_id") for p in parts if isinstance(p, dict)]
    return list(dict.fromkeys(j for j in ids if isinstance(j, str) and j))
