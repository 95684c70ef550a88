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

- **untrusted reads** (:func:`open_regular`, :func:`read_regular`): run directories,
  checkpoint folders, token stores, split caches and FASTA files are paths a job did not
  necessarily write: a named pipe there would block ``open`` forever, a device would never
  end, a symbolic link in a checkpoint folder could lead anywhere. The file is opened
  ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a writer), then ``fstat`` on
  the open descriptor (no race with a swap) must say regular file, and what is read is
  bounded. Both sides had written this rule, with different messages.

Errors are ``OSError`` (:class:`NotLockable` for a lock path that is something else) and,
for reads, :class:`NotRegular`: a phrase ("is a named pipe; allowed: a regular file") that
each side puts after the file's name in its own one-line error.
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


class NotLockable(OSError):
    """The lock path exists and is not a regular file (a FIFO, a device, a folder)."""


def acquire_lock(path: str | Path) -> int:
    """An exclusive ``flock`` on ``path`` (created 0644 if missing), held by the returned
    descriptor until it is closed; blocks while another process holds it.

    Never follows a link planted there (``O_NOFOLLOW``: ELOOP), never blocks on a FIFO
    (``O_NONBLOCK``: ENXIO without a reader), and locks only a regular file (checked on the
    descriptor, so no race with a swap): :class:`NotLockable` otherwise.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotLockable(f"{str(path)!r} is not a regular file")
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


class NotRegular(ValueError):
    """The path is not a readable regular file (or is too big); the message is a phrase.

    A ``ValueError`` (not ``OSError``): readers catch it beside the parse errors of what
    they read (``json``'s, a header's), as one kind of bad input."""


class Missing(NotRegular):
    """The path does not exist (a reader for which that is normal tells it apart)."""


def open_regular(path: str | Path, *, follow: bool = True) -> tuple[int, os.stat_result]:
    """(a blocking read-only descriptor, its fstat) of the regular file ``path``.

    ``follow=False`` refuses a symbolic link (``O_NOFOLLOW``), for folders whose files
    the project writes itself and never links (checkpoints).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise Missing("does not exist") from None
    except OSError as exc:
        if not follow and os.path.islink(path):
            raise NotRegular("is a symbolic link; allowed: a regular file") from None
        raise NotRegular(f"cannot be read ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(info.st_mode)
                else "a named pipe"
                if stat.S_ISFIFO(info.st_mode)
                else "a device or socket"
            )
            raise NotRegular(f"is {kind}; allowed: a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def read_regular(
    path: str | Path, limit: int | None, *, follow: bool = True
) -> tuple[bytes, os.stat_result]:
    """(bytes, fstat) of the regular file ``path`` (:func:`open_regular`), at most
    ``limit`` bytes (None: the size ``fstat`` gave, for a file as large as it is)."""
    fd, info = open_regular(path, follow=follow)
    try:
        if limit is not None and info.st_size > limit:
            raise NotRegular(f"is {info.st_size:,} bytes; allowed: at most {limit:,}")
        cap = info.st_size if limit is None else limit
        chunks: list[bytes] = []
        total = 0
        while True:
            try:
                chunk = os.read(fd, min(1 << 24, cap + 1 - total))
            except OSError as exc:
                raise NotRegular(f"cannot be read ({exc.strerror or exc})") from None
            if not chunk:
                return b"".join(chunks), info
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise NotRegular("grew while it was read; allowed: a finished file")
    finally:
        os.close(fd)
