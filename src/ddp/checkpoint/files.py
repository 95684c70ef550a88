"""Durable, atomic file writes and reads of untrusted files for checkpoints.

Every checkpoint file goes through :func:`atomic_save` / :func:`atomic_write_text`: a
temp file in the same directory, fsync, ``os.replace``, fsync of the directory, so a
``kill -9`` at any instant leaves the old file or the new one, never a torn one (the
mechanism is both sides' one atomic write, :class:`hpc_ddp.files.AtomicFile`). A
checkpoint directory is untrusted input, so its small files are read with
:func:`read_regular` (regular files only, never blocking, bounded).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import torch

from ddp.checkpoint.layout import DIGEST_SUFFIX
from hpc_ddp import files as _files
from hpc_ddp.files import AtomicFile
from hpc_ddp.files import fsync_dir as fsync_dir  # re-exported: ddp.checkpoint's name

log = logging.getLogger("ddp")


class _Staged(AtomicFile):
    """A checkpoint file written under a temp name in its final directory, made visible by
    commit(): both sides' atomic write (:class:`hpc_ddp.files.AtomicFile`), durable by
    default, owner-only (0600, as checkpoints always were), its folder made if missing,
    and a failure reported as the file system's error (:meth:`failed`).

    Same directory, so ``os.replace`` is atomic; ``commit`` fsyncs the file, renames it
    and fsyncs the directory so the rename itself survives a crash. Every atomic write
    here (checkpoints, their digests, ``latest``, the export) goes through this class.
    """

    def __init__(self, path: Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, mode=None)

    def commit(self, durable: bool = True) -> None:
        try:
            super().commit(durable)
        except BaseException as exc:
            raise self.failed(exc) from None

    def failed(self, exc: BaseException) -> BaseException:
        """Discard the temp file; what to raise for ``exc``: the file system's OSError
        (naming this file) where torch wrapped one (:func:`write_error`), else ``exc``."""
        self.discard()
        err = write_error(exc)
        if err is None:
            return exc
        if not err.filename:
            err.filename = str(self.path)
        return err


def write_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write (a full disk, a quota, a read-only file system),
    wherever it was wrapped; None when the failure is no file system error.

    ``torch.save`` into a file object turns the writer's ``OSError`` into a RuntimeError
    ("unexpected pos 704 vs 598") that keeps the OSError only as its ``__context__``;
    ``torch.distributed.checkpoint`` wraps each rank's failure in a CheckpointException
    (``failures``: rank -> exception). Every place that reports a failed checkpoint
    write asks this function, so "No space left on device" is what the user reads.
    """
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for _, failure in sorted(failures.items(), key=lambda kv: str(kv[0])):
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [e.__cause__, e.__context__]
    return None


def _atomic_write(path: Path, write: Callable[[Any], None], durable: bool = True) -> None:
    staged = _Staged(path)
    try:
        write(staged.fh)
    except BaseException as exc:
        raise staged.failed(exc) from None
    staged.commit(durable)


def atomic_save(obj: Any, path: str | Path, durable: bool = True) -> None:
    """``torch.save`` that never leaves a partial file at ``path``.

    Written to a temp file in the same directory (same filesystem, so
    ``os.replace`` is atomic), fsynced, renamed, then the directory is fsynced so
    the rename itself survives a crash.
    """
    _atomic_write(Path(path), lambda fh: torch.save(obj, fh), durable)


def atomic_save_digested(obj: Any, path: str | Path) -> None:
    """``torch.save`` to ``path`` atomically, with its ``.sha256`` file landing first."""
    path = Path(path)
    staged = _Staged(path)
    out = _Digesting(staged.fh)
    try:
        torch.save(obj, cast(IO[bytes], out))  # torch.save calls only write() and flush()
        staged.fh.flush()
        atomic_write_text(out.sha.hexdigest() + "\n", _digest_path(path))
    except BaseException as exc:
        raise staged.failed(exc) from None
    staged.commit()


def atomic_write_text(text: str, path: str | Path, durable: bool = True) -> None:
    _atomic_write(Path(path), lambda fh: fh.write(text.encode()), durable)


class _Digesting:
    """A write-only file wrapper that hashes what passes through (torch.save needs write)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def sha256_file(path: Path) -> str:
    """The digest of a regular file, read in chunks; ValueError for anything else (it is
    opened non-blocking, without following a link, and checked like :func:`read_regular`)."""
    sha = hashlib.sha256()
    try:
        fd, _ = _files.open_regular(path, follow=False)
    except _files.NotRegular as exc:
        raise ValueError(f"{path.name} {exc}") from None
    with os.fdopen(fd, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


# ---- untrusted files: regular files only, never blocking, bounded ------------------------
SMALL_FILE = 1 << 16
"""At most this many bytes in a pointer, digest or lock file (a few dozen when sound)."""


def _open_regular(path: Path, limit: int | None) -> tuple[bytes, os.stat_result]:
    """(bytes, fstat) of the regular file ``path``, never following a link
    (:func:`ddp._files.read_regular`); ValueError with a phrase otherwise."""
    return _files.read_regular(path, limit, follow=False)


def read_regular(path: str | Path, limit: int | None = SMALL_FILE) -> bytes:
    """The bytes of the regular file ``path``; ValueError naming what it is otherwise.

    A checkpoint directory is untrusted input: a named pipe there would block ``open``
    forever, a device would never end, a symbolic link could lead anywhere. The file is
    opened ``O_NONBLOCK | O_NOFOLLOW``, ``fstat`` on the open descriptor (no race with a
    swap) must say regular file, and at most ``limit`` bytes are read (None: the size
    ``fstat`` gave, for a checkpoint, which is as large as it is). The compute side's
    counterpart of ``hpc._util.read_regular`` (``ddp`` never imports ``hpc``); the
    ValueError is a phrase ("is a named pipe; allowed: a regular file") for the caller
    to put after the file's name.
    """
    return _open_regular(Path(path), limit)[0]
