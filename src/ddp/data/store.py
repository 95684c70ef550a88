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
end (:class:`ddp.data.store_write.StoreWriter`), so a half-written store is never
opened; a failure, a full disk or SIGTERM/SIGHUP/SIGINT removes the temporary directory.
``--force`` replaces only a folder that ddp.data wrote
(:func:`ddp.data.store_write.foreign`), never the input. This module opens and reads a
store; :mod:`ddp.data.store_write` writes one.

A store is untrusted input when opened (:class:`TokenStore`): every file is opened as
a regular file only (:func:`open_regular`: a named pipe is refused, not waited on),
the header is bounded and checked field by field, the files' sizes against its
counts, its vocabulary against the caller's tokenizer; every read checks its offsets
and token ids. A store with no tokens is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ddp.data.store_files import (  # noqa: F401  (re-exported: ddp.data.store.X is the name)
    STORE_MADE_BY,
    IndexArray,
    open_regular,
    read_regular,
)
from ddp.errors import ConfigError

FORMAT = 1
HEADER = "header.json"
FILES = ("tokens.bin", "offsets.bin", "idhash.bin")
MAX_HEADER = 1 << 20  # a real header is a few hundred bytes
MAX_COUNT = 1 << 48  # sequences or tokens: far beyond UniRef, far below int64 overflow
SPLIT = "split-v2"  # v2: empty sequences stay out of both sides
#: Every name ddp.data writes into a store folder: the files, the split caches and their
#: temporaries. A folder holding anything else is not replaced by ``--force``.
OWN_NAME = re.compile(
    r"header\.json|tokens\.bin|offsets\.bin|idhash\.bin|"
    r"split-[0-9a-z.+-]+\.(?:train|eval)\.bin(?:\.tmp-\d+)?"
)

log = logging.getLogger("ddp")


def _short(value: Any, n: int = 60) -> str:
    """``repr(value)`` cut to ``n`` characters: a crafted field must not flood the line."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def cache_dir() -> Path:
    """Where derived data goes when its own place is read-only: ``$DDP_DATA_CACHE``, else
    ``$XDG_CACHE_HOME/ddp/data`` (``~/.cache/ddp/data``)."""
    env = os.environ.get("DDP_DATA_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "ddp" / "data"


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


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


class TokenStore:
    """A store opened read-only; its header and sizes are checked on open.

    A store is untrusted input (copied, shared, hand-edited): every field of the header
    is checked for type and range, the files' sizes against the header's counts, and a
    damaged store stops with one line instead of an exception mid-training.
    ``tokenizer`` is the name the caller's model expects (a store made with another one
    is refused: its ids would mean other residues) and ``vocab_size`` that tokenizer's
    vocabulary (a store labelled with the name but another vocabulary is refused too:
    its ids would index past the model's embedding).
    """

    def __init__(
        self, path: str | Path, tokenizer: str | None = None, vocab_size: int | None = None
    ) -> None:
        self.path = Path(path)
        where = str(self.path)
        want = self._check_header(where, tokenizer, vocab_size)
        self._open_files(where, want)

    def _read_header(self, where: str) -> dict[str, Any]:
        """``header.json`` as an object of this store format (untrusted: a regular file,
        bounded, no NaN/Infinity constants); one line for anything else."""
        self._raw = read_regular(self.path / HEADER, STORE_MADE_BY, MAX_HEADER)
        try:
            header = json.loads(self._raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(
                f"{where!r}: damaged token store ({HEADER} is no JSON: "
                f"{_short(str(exc))}); prepare it again"
            ) from None
        if not isinstance(header, dict):
            raise ConfigError(
                f"{where!r}: damaged token store ({HEADER} holds "
                f"{type(header).__name__}, not an object); prepare it again"
            )
        fmt = header.get("format")
        if fmt != FORMAT or isinstance(fmt, bool):
            raise ConfigError(
                f"{where!r}: token store format {_short(fmt)}; expected {FORMAT} (prepare it again)"
            )
        return header

    def _check_header(
        self, where: str, tokenizer: str | None, vocab_size: int | None
    ) -> dict[str, int]:
        """Read and check ``header.json`` field by field (sets the counts, tokenizer and
        dtype); the byte size each file must have."""
        self.header = self._read_header(where)
        label = self._field("tokenizer", str, "a tokenizer name")
        if tokenizer is not None and label != tokenizer:
            raise ConfigError(
                f"{where!r}: a token store of tokenizer {label!r}; "
                f"expected {tokenizer!r} (prepare it again for this recipe)"
            )
        self.tokenizer: str = label
        self.vocab_size: int = self._field(
            "vocab_size", int, "an integer in [1, 2**32]", lambda v: 1 <= v <= 2**32
        )
        if vocab_size is not None and self.vocab_size != vocab_size:
            raise ConfigError(
                f"{where!r}: a token store labelled tokenizer {label!r} with "
                f"vocab_size {self.vocab_size}, but tokenizer {label!r} has "
                f"vocab_size {vocab_size}; prepare it again"
            )
        name = self._field(
            "dtype", str, "uint8, uint16 or uint32", lambda v: v in ("uint8", "uint16", "uint32")
        )
        self.dtype = np.dtype(name)
        if np.iinfo(self.dtype).max + 1 < self.vocab_size:
            raise ConfigError(
                f"{where!r}: damaged token store header (dtype {name} cannot "
                f"hold vocab_size {self.vocab_size}); prepare it again"
            )
        self.n_seqs: int = self._field(
            "n_seqs", int, f"an integer in [0, {MAX_COUNT}]", lambda v: 0 <= v <= MAX_COUNT
        )
        self.n_tokens: int = self._field(
            "n_tokens", int, f"an integer in [0, {MAX_COUNT}]", lambda v: 0 <= v <= MAX_COUNT
        )
        want = {
            "tokens.bin": self.n_tokens * self.dtype.itemsize,
            "offsets.bin": (self.n_seqs + 1) * 8,
            "idhash.bin": self.n_seqs * 4,
        }
        sizes = self.header.get("bytes")
        if sizes != want:
            raise ConfigError(
                f"{where!r}: damaged token store header (bytes: {_short(sizes)}; "
                f"its counts need {want}); prepare it again"
            )
        if not self.n_tokens:
            raise ConfigError(
                f"{where!r}: the token store holds no tokens ({self.n_seqs:,} "
                "empty sequences); prepare it from a FASTA file with residues"
            )
        return want

    def _open_files(self, where: str, want: dict[str, int]) -> None:
        """Open the three files read-only and check their sizes and offsets against the
        header's counts."""
        self._tok = IndexArray(self.path / "tokens.bin", self.dtype)
        self._off = IndexArray(self.path / "offsets.bin", np.dtype(np.int64))
        self._ids = IndexArray(self.path / "idhash.bin", np.dtype(np.uint32))
        for arr in (self._tok, self._off, self._ids):
            if arr.nbytes != want[arr.path.name]:
                raise ConfigError(
                    f"{where!r}: truncated or damaged token store ({arr.path.name} "
                    f"is {arr.nbytes} bytes, the header says "
                    f"{want[arr.path.name]}); prepare it again"
                )
        first, end = self._off[0], self._off[self.n_seqs]
        if first != 0 or end != self.n_tokens:
            raise ConfigError(
                f"{where!r}: damaged token store (offsets run {first}..{end}, "
                f"expected 0..{self.n_tokens}); prepare it again"
            )
        # Ids past the vocabulary would index past the model's embedding: every read
        # checks its few tokens (unless the dtype cannot hold such an id). One byte per
        # token (the FASTA stores): deleting the valid bytes must leave nothing, a C loop.
        self._check_ids = int(np.iinfo(self.dtype).max) >= self.vocab_size
        self._valid = bytes(range(min(self.vocab_size, 256)))

    def _field(self, key: str, kind: type, allowed: str, ok: Any = None) -> Any:
        value = self.header.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (ok and not ok(value)):
            raise ConfigError(
                f"{str(self.path)!r}: damaged token store header ({key}: "
                f"{_short(value)}; expected {allowed}); prepare it again"
            )
        return value

    def __len__(self) -> int:
        return self.n_seqs

    def read(self, i: int, limit: int | None = None) -> np.ndarray:
        """Sequence ``i``'s tokens (its first ``limit`` only): two ``pread`` calls."""
        if not 0 <= i < self.n_seqs:
            raise IndexError(f"sequence {i} of {self.n_seqs}")
        start, end = self._off.slice(i, 2).tolist()
        if not 0 <= start <= end <= self.n_tokens:
            raise ConfigError(
                f"{str(self.path)!r}: damaged token store (sequence {i} has "
                f"offsets {start}..{end} of {self.n_tokens} tokens); "
                "prepare it again"
            )
        if limit is not None:
            end = min(end, start + limit)
        data = self._tok.read_bytes(start, end - start)
        if self._check_ids and (
            data.translate(None, self._valid)
            if self.dtype.itemsize == 1
            else int(np.frombuffer(data, self.dtype).max(initial=0)) >= self.vocab_size
        ):
            top = int(np.frombuffer(data, self.dtype).max())
            raise ConfigError(
                f"{str(self.path)!r}: damaged token store (token id {top} in "
                f"sequence {i}, vocab_size {self.vocab_size}); prepare it again"
            )
        return np.frombuffer(data, self.dtype)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.read(int(i))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "tokenizer": self.tokenizer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["tokenizer"])  # type: ignore[misc]

    @property
    def tokens(self) -> np.ndarray:
        """Every token, memory-mapped read-only (whole-array work; samples use read())."""
        return np.memmap(self.path / "tokens.bin", dtype=self.dtype, mode="r")

    @property
    def offsets(self) -> np.ndarray:
        return np.memmap(self.path / "offsets.bin", dtype=np.int64, mode="r")

    def split(
        self, fraction: float, salt: int = 0, cache: str | Path | None = None
    ) -> tuple[IndexArray | np.ndarray, IndexArray | np.ndarray]:
        """(train, eval) sequence numbers: sequence i is in eval when
        ``mix(idhash[i] + salt) < fraction * 2**32``; empty sequences are in neither.

        The rule looks at one sequence's id only, so it needs no pass over the file
        before training, keeps a sequence on the same side when the file is reordered
        or grows, and gives every rank the same split. The index arrays are computed
        once per (fraction, salt), in chunks (flat memory), and cached as files written
        atomically, read an element at a time: in the store directory, or, when that is
        read-only (a shared store), under ``cache`` (default :func:`cache_dir`); when
        neither can be written, they are kept in memory.
        """
        name = f"{SPLIT}-{fraction:.6g}-{salt}"
        dt = np.dtype(np.uint32 if self.n_seqs < 2**32 else np.uint64)
        folders = [self.path, self._split_cache(cache)]
        for folder in folders:
            files = [folder / f"{name}.{part}.bin" for part in ("train", "eval")]
            if all(os.path.lexists(f) for f in files):
                return self._load_split(files, dt)
        for folder in folders:
            files = [folder / f"{name}.{part}.bin" for part in ("train", "eval")]
            try:
                self._write_split(files, fraction, salt, dt)
            except OSError as exc:
                log.debug("split cache not written in %s: %s", folder, exc.strerror)
                continue
            return self._load_split(files, dt)
        log.warning(
            "%s: no writable place for the split's index files (the store and %s are "
            "read-only); keeping them in memory",
            self.path,
            folders[-1],
        )
        parts = list(self._split_chunks(fraction, salt, dt))
        return (
            np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dt),
            np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dt),
        )

    def _split_cache(self, cache: str | Path | None) -> Path:
        """The split's folder outside the store, named after the store's path and header
        and its id file's identity, so a store prepared again never meets a stale split."""
        st = os.stat(self._ids.path)
        key = hashlib.sha1(
            b"\0".join(
                [
                    os.path.realpath(self.path).encode(),
                    self._raw,
                    f"{st.st_size}:{st.st_mtime_ns}".encode(),
                ]
            )
        ).hexdigest()
        return Path(cache or cache_dir()) / "splits" / f"{self.path.name}-{key[:16]}"

    def _load_split(self, files: list[Path], dt: np.dtype) -> tuple[IndexArray, IndexArray]:
        arrays = (IndexArray(files[0], dt), IndexArray(files[1], dt))
        for arr in arrays:
            if arr.nbytes % dt.itemsize:
                raise ConfigError(
                    f"{str(arr.path)!r}: damaged split cache ({arr.nbytes} bytes, "
                    f"not a whole number of {dt.name}); delete it"
                )
        if len(arrays[0]) + len(arrays[1]) > self.n_seqs:
            raise ConfigError(
                f"{str(files[0])!r}: damaged split cache ({len(arrays[0])} + "
                f"{len(arrays[1])} entries for {self.n_seqs} sequences); delete it"
            )
        return arrays

    def _split_chunks(
        self, fraction: float, salt: int, dt: np.dtype
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(train, eval) indices, a few million sequences at a time (pread: no RSS)."""
        cut = np.uint64(int(fraction * 2**32))
        chunk = 1 << 22
        empty = 0
        for start in range(0, self.n_seqs, chunk):
            count = min(chunk, self.n_seqs - start)
            h = self._ids.slice(start, count)
            real = np.diff(self._off.slice(start, count + 1)) > 0
            empty += count - int(real.sum())
            with np.errstate(over="ignore"):
                key = _mix64(h.astype(np.uint64) + np.uint64(salt))
            idx = np.arange(start, start + count, dtype=dt)
            is_eval = key < cut
            yield idx[real & ~is_eval], idx[real & is_eval]
        if empty:
            log.info("%s: %d empty sequences stay out of training and evaluation", self.path, empty)

    def _write_split(self, files: list[Path], fraction: float, salt: int, dt: np.dtype) -> None:
        files[0].parent.mkdir(parents=True, exist_ok=True)
        tmps = [f.with_name(f"{f.name}.tmp-{os.getpid()}") for f in files]
        try:
            with open(tmps[0], "wb") as tr, open(tmps[1], "wb") as ev:
                for train, evals in self._split_chunks(fraction, salt, dt):
                    tr.write(train.tobytes())
                    ev.write(evals.tobytes())
            for tmp, f in zip(tmps, files, strict=True):
                os.replace(tmp, f)
        finally:
            for tmp in tmps:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
