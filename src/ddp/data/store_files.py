"""Reading a token store's files: regular files only, never blocking, bounded, and the
on-disk arrays (:class:`IndexArray`) a store's split is read through with ``os.pread``.

Split from :mod:`ddp.data.store` (which re-exports every name here) by what a reader
looks for: how an untrusted file of a store is opened and read (a named pipe refused, not
waited on; every refusal one :class:`ddp.errors.ConfigError` line), apart from what the
store's header and samples mean.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from ddp.errors import ConfigError
from hpc_ddp import files as _files

STORE_MADE_BY = "a token store directory made by python -m ddp.data"


# ---- untrusted files: regular files only, never blocking, bounded -------------------------
def open_regular(path: str | Path, expected: str) -> int:
    """A read-only descriptor of the regular file ``path`` (:func:`ddp._files.open_regular`:
    a named pipe is refused, not waited on), else one-line ConfigError; ``expected``
    completes the message ("expected a FASTA file")."""
    try:
        return _files.open_regular(path)[0]
    except _files.NotRegular as exc:
        raise ConfigError(f"{str(path)!r} {exc}; expected {expected}") from None


def read_regular(path: str | Path, expected: str, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` (one-line ConfigError)."""
    try:
        return _files.read_regular(path, limit)[0]
    except _files.NotRegular as exc:
        raise ConfigError(f"{str(path)!r} {exc}; expected {expected}") from None


class IndexArray:
    """A read-only array in a regular file, read with ``os.pread`` (see the module
    docstring).

    The file is opened at once (:func:`open_regular`: a named pipe is refused, not
    waited on), and again after a fork or unpickling, so the object travels to
    DataLoader workers as a path."""

    def __init__(self, path: str | Path, dtype: np.dtype) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self._fd: int | None = None
        self._pid = 0
        fd = self._handle()
        self.nbytes = os.fstat(fd).st_size
        self._len = self.nbytes // self.dtype.itemsize

    def _handle(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = open_regular(self.path, f"a file of {STORE_MADE_BY}")
            self._pid = os.getpid()
        return self._fd

    def __len__(self) -> int:
        return self._len

    def read_bytes(self, start: int, count: int) -> bytes:
        """The bytes of elements ``start .. start + count`` (exactly those read)."""
        size = self.dtype.itemsize
        data = os.pread(self._handle(), count * size, start * size)
        if len(data) != count * size:
            raise ConfigError(
                f"{str(self.path)!r}: truncated (wanted {count} elements at "
                f"{start}); prepare the store again"
            )
        return data

    def slice(self, start: int, count: int) -> np.ndarray:
        """Elements ``start .. start + count`` (a copy, exactly that many bytes read)."""
        return np.frombuffer(self.read_bytes(start, count), dtype=self.dtype)

    def __getitem__(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} of {self._len}")
        return int(self.slice(i, 1)[0])

    def to_numpy(self) -> np.ndarray:
        """The whole array in memory (tests, small stores)."""
        return self.slice(0, self._len).copy()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "dtype": self.dtype.str}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], np.dtype(state["dtype"]))  # type: ignore[misc]

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._fd)
