"""A token store on disk: every sequence's tokens in one flat memory-mapped array.

Layout of a store directory (format 1)::

    header.json   {"format", "tokenizer", "vocab_size", "dtype", "n_seqs", "n_tokens",
                   "bytes": {file: size}, "source"}
    tokens.bin    all token ids back to back (uint8 when the vocabulary fits, else
                  uint16/uint32)
    offsets.bin   int64, n_seqs + 1 entries: sequence i is tokens[offsets[i]:offsets[i+1]]
    idhash.bin    uint32 per sequence: a hash of its id (FASTA: the header's first word),
                  for the evaluation split rule (:meth:`TokenStore.split`)

Why this shape (nanoGPT's ``np.memmap`` token files, plus offsets for variable
lengths): opening a store reads a few hundred bytes and a sample is two small reads at
known offsets, so a rank's memory does not grow with the number of sequences; the
file pages live in the page cache, shared by every rank on the node.

Samples are read with ``os.pread``, not through the memory map (which stays
available as :attr:`TokenStore.tokens` for whole-array work): on current kernels a
page fault on a mapped file maps a whole large folio of the page cache (hundreds of
KB) into the process, so random access through a map makes a rank's resident memory
grow with the file it wanders over (measured: +140 MB after 640 random samples of a
200 MB store). ``pread`` copies exactly the bytes asked for, cropped to ``max_len``.

A store is written into a temporary sibling directory and renamed into place at the
end (:class:`StoreWriter`), so a half-written store is never opened; the header's
byte sizes catch one that was truncated afterwards (a copy cut short, a full disk).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ddp.errors import ConfigError

FORMAT = 1
HEADER = "header.json"
FILES = ("tokens.bin", "offsets.bin", "idhash.bin")


def is_store(path: str | Path) -> bool:
    """Whether ``path`` is a directory that claims to be a store (has a header)."""
    return (Path(path) / HEADER).is_file()


def _dtype_for(vocab_size: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def hash_index(i: np.ndarray) -> np.ndarray:
    """uint32 hash of sequence numbers: the id hash of sequences written without an id."""
    return _mix64(i.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint32)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorised (wrapping uint64 arithmetic): spreads every
    input bit over the output so that ``hash < fraction * 2**32`` is a fair coin."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x >> np.uint64(32)


def hash_ids(ids: Sequence[str]) -> np.ndarray:
    """uint32 hashes of string ids (the writer's Python path; FASTA hashes vectorised)."""
    out = np.fromiter((zlib.crc32(s.encode()) for s in ids), dtype=np.uint64, count=len(ids))
    return _mix64(out).astype(np.uint32)


class StoreWriter:
    """Builds a store from sequences of token ids, atomically.

    Use as a context manager: the store appears at ``out`` only when the block ends
    without an exception; otherwise the temporary directory is removed. Sequences are
    appended in batches (:meth:`add_flat` takes an already flat token array plus
    lengths: the FASTA path's vectorised output) or one by one (:meth:`add`).
    """

    def __init__(self, out: str | Path, tokenizer: str, vocab_size: int,
                 source: str = "", overwrite: bool = False,
                 extra: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.out = Path(out)
        if self.out.exists() and not overwrite:
            raise ConfigError(f"{str(self.out)!r} exists; allowed: a new directory or --force")
        self.tokenizer, self.vocab_size, self.source = tokenizer, vocab_size, source
        self.extra = dict(extra or {})
        self.dtype = _dtype_for(vocab_size)
        self.n_seqs = 0
        self.n_tokens = 0
        self._closed = 0  # tokens that belong to sequences already ended
        self._tmp: Path | None = None
        self._fh: dict[str, Any] = {}

    def __enter__(self) -> StoreWriter:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        self._fh = {name: open(self._tmp / name, "wb") for name in FILES}  # noqa: SIM115
        self._fh["offsets.bin"].write(np.zeros(1, np.int64).tobytes())
        return self

    def add_tokens(self, tokens: np.ndarray) -> None:
        """Append tokens of sequences still open; :meth:`end_sequences` gives their lengths.

        The streaming FASTA reader writes a chunk's tokens before it knows where the
        last sequence of the chunk ends."""
        if len(tokens) and int(np.max(tokens)) >= self.vocab_size:
            raise ValueError(f"token id {int(np.max(tokens))} >= vocab_size {self.vocab_size}")
        self._fh["tokens.bin"].write(np.ascontiguousarray(tokens, dtype=self.dtype).data)
        self.n_tokens += len(tokens)

    def end_sequences(self, lengths: np.ndarray, idhash: np.ndarray | None = None) -> None:
        """Close ``len(lengths)`` sequences made of the next tokens written so far."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if idhash is None:
            idhash = hash_index(np.arange(self.n_seqs, self.n_seqs + len(lengths)))
        offsets = self._closed + np.cumsum(lengths)
        if len(offsets):
            self._closed = int(offsets[-1])
        if self._closed > self.n_tokens:
            raise ValueError("sequence lengths exceed the tokens written")
        self._fh["offsets.bin"].write(offsets.tobytes())
        self._fh["idhash.bin"].write(np.asarray(idhash, dtype=np.uint32).tobytes())
        self.n_seqs += len(lengths)

    def add_flat(self, tokens: np.ndarray, lengths: np.ndarray,
                 idhash: np.ndarray | None = None) -> None:  # fmt: skip
        """Append ``len(lengths)`` sequences whose tokens lie back to back in ``tokens``."""
        if int(np.sum(lengths)) != len(tokens):
            raise ValueError("sum(lengths) != len(tokens)")
        self.add_tokens(tokens)
        self.end_sequences(lengths, idhash)

    def add(self, seq: Sequence[int] | np.ndarray, id: str | None = None) -> None:
        """Append one sequence (slow path for user scripts; batches go to add_flat)."""
        arr = np.asarray(seq, dtype=np.int64)
        h = hash_ids([id]) if id is not None else None
        self.add_flat(arr, np.array([len(arr)]), h)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._tmp is not None
        for fh in self._fh.values():
            fh.close()
        if exc_type is None and self._closed != self.n_tokens:
            exc_type = ValueError  # tokens of an unfinished sequence: never publish
        if exc_type is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            if exc is None:
                raise ValueError(f"{self.n_tokens - self._closed} tokens belong to no sequence")
            return
        try:
            header = {
                "format": FORMAT, "tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                "dtype": self.dtype.name, "n_seqs": self.n_seqs, "n_tokens": self.n_tokens,
                "bytes": {n: (self._tmp / n).stat().st_size for n in FILES},
                "source": self.source, **self.extra,
            }  # fmt: skip
            (self._tmp / HEADER).write_text(json.dumps(header, indent=1) + "\n")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self._tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide it from the group
            for name in (*FILES, HEADER):
                with open(self._tmp / name, "rb+") as fh:
                    os.fsync(fh.fileno())
            if self.out.exists():  # --force: the old store goes only once the new one is whole
                old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
                os.replace(self.out, old)
                os.replace(self._tmp, self.out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                try:
                    os.replace(self._tmp, self.out)
                except OSError:
                    if not (self.out / HEADER).is_file():
                        raise
                    # Another process (a second job on the same FASTA) published the same
                    # store first: theirs is as good as ours.
                    shutil.rmtree(self._tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise


def write_store(out: str | Path, seqs: Iterable[Sequence[int]], tokenizer: str,
                vocab_size: int, ids: Iterable[str] | None = None) -> TokenStore:  # fmt: skip
    """Build a store from any iterable of token sequences (and optional ids); returns it."""
    with StoreWriter(out, tokenizer, vocab_size) as w:
        id_iter = iter(ids) if ids is not None else None
        for seq in seqs:
            w.add(seq, next(id_iter) if id_iter is not None else None)
    return TokenStore(out, tokenizer)


class TokenStore:
    """A store opened read-only; checks format, tokenizer and sizes on open.

    ``tokenizer``: the name the caller's model expects; a store made with another
    one is refused with one line (its token ids would mean other residues).
    """

    def __init__(self, path: str | Path, tokenizer: str | None = None) -> None:
        self.path = Path(path)
        where = str(self.path)
        try:
            header = json.loads((self.path / HEADER).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where!r}: not a token store (unreadable {HEADER}: {exc}); "
                              "expected a directory made by python -m ddp.data") from None  # fmt: skip
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ConfigError(f"{where!r}: token store format {header.get('format')!r}; "
                              f"expected {FORMAT} (prepare it again)")  # fmt: skip
        self.header = header
        if tokenizer is not None and header.get("tokenizer") != tokenizer:
            raise ConfigError(f"{where!r}: a token store of tokenizer {header.get('tokenizer')!r}; "
                              f"expected {tokenizer!r} (prepare it again for this recipe)")  # fmt: skip
        for name, size in header["bytes"].items():
            f = self.path / name
            have = f.stat().st_size if f.is_file() else None
            if have != size:
                raise ConfigError(f"{where!r}: truncated or damaged token store ({name} is "
                                  f"{have} bytes, the header says {size}); prepare it again")  # fmt: skip
        self.n_seqs: int = header["n_seqs"]
        self.n_tokens: int = header["n_tokens"]
        self.vocab_size: int = header["vocab_size"]
        self.tokenizer: str = header["tokenizer"]
        self.dtype = np.dtype(header["dtype"])
        self._tok = IndexArray(self.path / "tokens.bin", self.dtype)
        self._off = IndexArray(self.path / "offsets.bin", np.dtype(np.int64))
        end = self._off[self.n_seqs]
        if end != self.n_tokens:
            raise ConfigError(f"{where!r}: damaged token store (offsets end at {end}, "
                              f"expected {self.n_tokens})")  # fmt: skip

    def __len__(self) -> int:
        return self.n_seqs

    def read(self, i: int, limit: int | None = None) -> np.ndarray:
        """Sequence ``i``'s tokens (its first ``limit`` only): two ``pread`` calls."""
        if not 0 <= i < self.n_seqs:
            raise IndexError(f"sequence {i} of {self.n_seqs}")
        start, end = self._off.slice(i, 2)
        if limit is not None:
            end = min(end, start + limit)
        return self._tok.slice(int(start), int(end - start))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.read(int(i))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "tokenizer": self.tokenizer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["tokenizer"])  # type: ignore[misc]

    @property
    def tokens(self) -> np.ndarray:
        """Every token, memory-mapped read-only (whole-array work; samples use read())."""
        if not self.n_tokens:
            return np.zeros(0, self.dtype)
        return np.memmap(self.path / "tokens.bin", dtype=self.dtype, mode="r")

    @property
    def offsets(self) -> np.ndarray:
        return np.memmap(self.path / "offsets.bin", dtype=np.int64, mode="r")

    def split(self, fraction: float, salt: int = 0) -> tuple[IndexArray, IndexArray]:
        """(train, eval) sequence numbers: sequence i is in eval when
        ``mix(idhash[i] + salt) < fraction * 2**32``.

        The rule looks at one sequence's id only, so it needs no pass over the file
        before training, keeps a sequence on the same side when the file is reordered
        or grows, and gives every rank the same split. The index arrays are computed
        once per (fraction, salt), in chunks (flat memory), and cached in the store
        directory as files written atomically, read an element at a time.
        """
        name = f"split-{fraction:.6g}-{salt}"
        files = [self.path / f"{name}.{part}.bin" for part in ("train", "eval")]
        dt = np.uint32 if self.n_seqs < 2**32 else np.uint64
        if not all(f.is_file() for f in files):
            self._write_split(files, fraction, salt, dt)
        return IndexArray(files[0], np.dtype(dt)), IndexArray(files[1], np.dtype(dt))

    def _write_split(self, files: list[Path], fraction: float, salt: int, dt: type) -> None:
        cut = np.uint64(int(fraction * 2**32))
        tmps = [f.with_name(f"{f.name}.tmp-{os.getpid()}") for f in files]
        chunk = 1 << 22
        with open(tmps[0], "wb") as tr, open(tmps[1], "wb") as ev, \
                open(self.path / "idhash.bin", "rb") as fh:  # fmt: skip
            start = 0
            while start < self.n_seqs:
                h = np.fromfile(fh, dtype=np.uint32, count=chunk)  # not the memmap: no RSS
                key = _mix64(h.astype(np.uint64) + np.uint64(salt))
                idx = np.arange(start, start + len(h), dtype=dt)
                is_eval = key < cut
                tr.write(idx[~is_eval].tobytes())
                ev.write(idx[is_eval].tobytes())
                start += len(h)
        for tmp, f in zip(tmps, files, strict=True):
            os.replace(tmp, f)


class IndexArray:
    """A read-only array in a file, read with ``os.pread`` (see the module docstring).

    The file descriptor is opened lazily and reopened after a fork or unpickling, so the
    object travels to DataLoader workers as a path."""

    def __init__(self, path: str | Path, dtype: np.dtype) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self._len = self.path.stat().st_size // self.dtype.itemsize
        self._fd: int | None = None
        self._pid = 0

    def _handle(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pid = os.getpid()
        return self._fd

    def __len__(self) -> int:
        return self._len

    def slice(self, start: int, count: int) -> np.ndarray:
        """Elements ``start .. start + count`` (a copy, exactly that many bytes read)."""
        size = self.dtype.itemsize
        data = os.pread(self._handle(), count * size, start * size)
        if len(data) != count * size:
            raise ConfigError(f"{str(self.path)!r}: truncated (wanted {count} elements at "
                              f"{start}); prepare the store again")  # fmt: skip
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} of {self._len}")
        return int(self.slice(i, 1)[0])

    def to_numpy(self) -> np.ndarray:
        """The whole array in memory (tests, small stores)."""
        return np.fromfile(self.path, dtype=self.dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "dtype": self.dtype.str}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], np.dtype(state["dtype"]))  # type: ignore[misc]

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._fd)
