"""Untrusted files on the compute side: regular files only, never blocking, bounded.

Checkpoint folders, token stores, split caches and FASTA files are paths a job did not
necessarily write: a named pipe there would block ``open`` forever, a device would never
end, a symbolic link in a checkpoint folder could lead anywhere. Every reader of such a
file opens it here: ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a
writer), then ``fstat`` on the open descriptor (no race with a swap) must say regular
file. Failures are a :class:`NotRegular` phrase ("is a named pipe; allowed: a regular
file") for the caller to put after the file's name in its own one-line error. The login
side's counterpart is ``hpc._util.read_regular`` (``ddp`` never imports ``hpc``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotRegular(ValueError):
    """The path is not a readable regular file (or is too big); the message is a phrase."""


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
        raise NotRegular("does not exist") from None
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
