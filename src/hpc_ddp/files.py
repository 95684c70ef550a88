"""Atomic writes and run-directory locks, one mechanism for both sides.

A run directory is written by the login side (``hpc submit``'s ``run.json``, the runs
index) and by the compute side (the supervisor's events in ``run.json``, heartbeats,
checkpoints) at the same time, and read by both. Two rules make that safe, and both were
written on each side and had drifted (a fixed temporary name that follows a planted link
on one side, ``mkstemp`` on the other; a lock that checked for a regular file on one side
only):

- **atomic write** (:class:`AtomicFile`, :func:`write_atomic`): the bytes go to a
  ``mkstemp`` file in the target's folder (``O_EXCL``, an unpredictable name, so a
  symbolic link someone placed there is never followed), and ``os.replace`` swaps it in:
  a reader sees the old file or the new one, never half; a ``kill -9`` leaves the old one.
  ``durable`` adds the fsyncs that make the swap survive a power cut (checkpoints).
- **lock** (:func:`acquire_lock`, :func:`locked`): an exclusive ``flock`` on a regular
  file that is opened without following a link and without blocking on a FIFO. ``flock``
  (not ``lockf``) because both sides' processes must exclude each other on the same file
  and ``flock`` locks are per open file, not per process, so two threads of one process
  exclude each other too.

Errors are ``OSError`` (:class:`NotRegular` for a lock path that is something else); each
side words them as its own one-line error.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

PUBLIC_MODE = 0o644
"""The mode a written file gets, less the umask: what a plain ``open(path, "w")`` gives
the other files of a run directory (``mkstemp`` alone would leave it 0600)."""


def fsync_dir(path: Path) -> None:
    """Make a rename or new file in ``path`` durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems refuse to open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def umask() -> int:
    """The process's umask, read without changing it where Linux says it
    (``/proc/self/status``, kernel 4.7+): setting it and putting it back, the portable
    way, leaves a window in which another thread's new file gets no umask at all (the
    compute side writes heartbeats and checkpoints from threads)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


class AtomicFile:
    """A file written under a temporary name in its final folder, made visible by
    :meth:`commit` (or removed by :meth:`discard`).

    ``fh`` is the open binary file to write (a streaming writer such as ``torch.save``
    writes into it). ``mode``: the permission bits the file gets, less the umask; None keeps
    ``mkstemp``'s owner-only 0600 (checkpoints have always been written so).
    """

    def __init__(self, path: str | Path, mode: int | None = PUBLIC_MODE) -> None:
        self.path = Path(path)
        self.mode = mode
        fd, self.tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
        )
        self.fh = os.fdopen(fd, "wb")

    def commit(self, durable: bool = False) -> None:
        """Flush (and with ``durable`` fsync) the file, swap it in, fsync the folder.
        On an error the temporary file is removed and the error raised."""
        try:
            try:
                self.fh.flush()
                if durable:
                    os.fsync(self.fh.fileno())
            finally:
                self.fh.close()
            if self.mode is not None:
                os.chmod(self.tmp, self.mode & ~umask())
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        if durable:
            fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Close and remove the temporary file (nothing else is touched)."""
        with contextlib.suppress(OSError):
            self.fh.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


def write_atomic(
    path: str | Path, data: bytes | str, *, durable: bool = False, mode: int | None = PUBLIC_MODE
) -> None:
    """Write ``data`` (text is UTF-8) to ``path`` all or nothing (see :class:`AtomicFile`)."""
    staged = AtomicFile(path, mode)
    try:
        staged.fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    except BaseException:
        staged.discard()
        raise
    staged.commit(durable)


class NotRegular(OSError):
    """The lock path exists and is not a regular file (a FIFO, a device, a folder)."""


def acquire_lock(path: str | Path) -> int:
    """An exclusive ``flock`` on ``path`` (created 0644 if missing), held by the returned
    descriptor until it is closed; blocks while another process holds it.

    Never follows a link planted there (``O_NOFOLLOW``: ELOOP), never blocks on a FIFO
    (``O_NONBLOCK``: ENXIO without a reader), and locks only a regular file (checked on the
    descriptor, so no race with a swap): :class:`NotRegular` otherwise.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular(f"{str(path)!r} is not a regular file")
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """Hold :func:`acquire_lock` on ``path`` for the ``with`` block."""
    fd = acquire_lock(path)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock
