"""``hpc logs RUN_DIR|JOB_ID [-f]``: find a run's job log and print it, following it as it grows.

Which file is the log (each scheduler names its own) is :mod:`hpc.logs_find`; per-rank
logs and a merged log's rank labels (``--rank``, ``--grep``) :mod:`hpc.logs_ranks`. This
module prints a log (:func:`print_log`) and follows it (:func:`follow`, asking the
scheduler on a :class:`Backoff`); every name of the three is importable from here.
"""

from __future__ import annotations

import codecs
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from hpc._pipes import reader_gone
from hpc.errors import UserError
from hpc.logs_find import err_log, find_log, job_key, locate
from hpc.logs_ranks import (
    _HEADER,
    _LABEL,
    RANKS_DIR,
    _hosts,
    _merged,
    grep,
    labelled_lines,
    print_rank,
    rank_log,
    rank_logs,
)

#: ``_HEADER``, ``_LABEL``, ``_hosts`` and ``_merged`` stay reachable as ``hpc.logs.X``
#: (hpc.failure read them here before the split).
__all__ = [
    "RANKS_DIR",
    "_HEADER",
    "_LABEL",
    "Backoff",
    "_hosts",
    "_merged",
    "err_log",
    "find_log",
    "follow",
    "grep",
    "job_key",
    "labelled_lines",
    "locate",
    "print_log",
    "print_rank",
    "rank_log",
    "rank_logs",
]


class Backoff:
    """When ``hpc logs -f`` asks the scheduler again: now, then after ``first_s``, and
    twice as long each time up to ``most_s`` (the profile's ``poll_s``).

    A shared scheduler answers every user's queries; a follow that asked every half
    second for a day-long job made 170,000 of them. The log itself is a local file
    and is still read every poll: only the scheduler is asked less often, so the end
    of a job shows at most ``most_s`` late. ``clock``: for tests.
    """

    def __init__(
        self,
        first_s: float = 1.0,
        most_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.most_s = most_s
        self.interval = min(first_s, most_s)
        self.clock = clock
        self.next: float | None = None

    def due(self) -> bool:
        """True when it is time to ask (and then the next time is set)."""
        now = self.clock()
        if self.next is not None and now < self.next:
            return False
        self.next = now + self.interval
        self.interval = min(self.interval * 2, self.most_s)
        return True


def follow(
    path: Path,
    is_running: Callable[[], bool],
    out: TextIO,
    poll_s: float = 0.5,
    settle_s: float = 0.0,
    ask: Backoff | None = None,
) -> None:
    """Print ``path`` and then what is appended to it until the job ends.

    ``is_running`` is asked before a read (every read, or when ``ask`` says it is
    time: a scheduler query backs off, the file read does not), so once it says False
    one more read prints everything the job wrote before it ended. A file that does not exist yet is
    waited for; one truncated in place is read again from the start; one replaced
    (rotation: a new inode at the path) is read to its end, then the new one from the
    start. Bytes are decoded incrementally, so a UTF-8 character split across two
    reads prints whole, and undecodable bytes print as U+FFFD instead of failing.

    ``settle_s``: after the job ends, keep reading until the file has not grown for this
    long. A scheduler may append its own last lines (SLURM's ``CANCELLED`` notice) after
    the job's state changed, and a login node on NFS may see the last writes late.

    A reader of ``out`` that left (``| grep -m1 started``) ends the follow at the next
    poll with ``BrokenPipeError``, as ``tail -f`` does, although the job may write
    nothing for hours (a write would be the first to notice).
    """
    fh = None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        running = True
        while True:
            if ask is None or ask.due():
                running = is_running()
            fh = _reopen_if_replaced(path, fh, decoder, out)
            if fh is not None:
                _drain(fh, decoder, out)
            if not running:
                fh = _settle(path, fh, decoder, out, poll_s, settle_s)
                out.write(decoder.decode(b"", final=True))
                out.flush()
                return
            if reader_gone(out):
                raise BrokenPipeError(errno.EPIPE, "the reader of the output left")
            time.sleep(poll_s)
    finally:
        if fh is not None:
            fh.close()


def _settle(
    path: Path,
    fh: Any,
    decoder: codecs.IncrementalDecoder,
    out: TextIO,
    poll_s: float,
    settle_s: float,
) -> Any:
    """Read on until ``path`` has not grown for ``settle_s`` seconds; the handle read last."""
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < settle_s:
        time.sleep(min(poll_s, settle_s) or 0.01)
        before = fh.tell() if fh is not None else -1
        fh = _reopen_if_replaced(path, fh, decoder, out)
        if fh is not None:
            _drain(fh, decoder, out)
            if fh.tell() != before:
                quiet_since = time.monotonic()
    return fh


def _reopen_if_replaced(
    path: Path, fh: Any, decoder: codecs.IncrementalDecoder, out: TextIO
) -> Any:
    """The handle to read next: opened once the file exists, reopened after rotation."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return fh  # not there yet, or moved away mid-rotation: keep what we have
    except OSError as exc:
        raise UserError(f"logs: {str(path)!r} cannot be read ({exc.strerror})") from None
    if fh is not None:
        cur = os.fstat(fh.fileno())
        if (cur.st_ino, cur.st_dev) == (st.st_ino, st.st_dev):
            if cur.st_size < fh.tell():  # truncated in place (copytruncate): start over
                fh.seek(0)
            return fh
        _drain(fh, decoder, out)  # the rest of the rotated file first
        fh.close()
    return _open_log(path)


def _open_log(path: Path) -> Any:
    """The log opened for reading, None while it does not exist; a named pipe (whose
    ``open`` would wait for a writer forever) or a device is refused (``open_regular``)."""
    from hpc._util import open_regular

    return open_regular(path, "logs", missing_ok=True)  # closed by the caller


def _drain(fh: Any, decoder: codecs.IncrementalDecoder, out: TextIO) -> None:
    wrote = False
    while chunk := fh.read(65536):
        out.write(decoder.decode(chunk))
        wrote = True
    if wrote:
        out.flush()


def print_log(path: Path, out: TextIO) -> None:
    """Print a job's log as it is now (``hpc logs`` without ``-f``).

    Bounded by the size the log has when opened: a job that writes faster than the
    terminal reads would otherwise keep this going for as long as it runs (``-f`` is
    for that)."""
    fh = _open_log(path)
    if fh is None:
        raise UserError(
            f"logs: {str(path)!r} does not exist yet (the job has not started?); "
            "allowed: hpc logs -f to wait for it"
        )
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with fh:
        left = os.fstat(fh.fileno()).st_size
        while left > 0 and (chunk := fh.read(min(65536, left))):
            left -= len(chunk)
            out.write(decoder.decode(chunk))
    out.write(decoder.decode(b"", final=True))
    out.flush()
