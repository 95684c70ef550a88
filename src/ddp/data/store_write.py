"""Writing a token store (:mod:`ddp.data.store` describes its layout), atomically.

:class:`StoreWriter` writes into a temporary sibling directory and renames it into place
at the end, so a half-written store is never opened; a failure, a full disk (one line,
:class:`StoreWriteError`) or SIGTERM/SIGHUP/SIGINT (:class:`Interrupted`, delivered once
the folder is clean) removes the temporary directory. ``--force`` replaces only a folder
that ddp.data wrote (:func:`foreign`), never the input.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from ddp.data.store import (
    FILES,
    FORMAT,
    HEADER,
    OWN_NAME,
    TokenStore,
    _dtype_for,
    hash_ids,
    hash_index,
    is_store,
)
from ddp.errors import ConfigError

log = logging.getLogger("ddp")


def foreign(path: str | Path) -> str | None:
    """Why the existing ``path`` is not a store that ddp.data wrote; None when it is one.

    The rule ``--force`` follows (as git never deletes what it did not create): a real
    folder (not a link) with a ``header.json`` and nothing but names ddp.data writes
    (:data:`OWN_NAME`). Its header need not parse: a damaged store may be replaced.
    An empty folder holds nothing to lose, so it counts as one (as ``git clone`` fills
    an empty folder).
    """
    p = Path(path)
    try:
        mode = os.lstat(p).st_mode
    except FileNotFoundError:
        return "gone"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if not stat.S_ISDIR(mode):
        return "a file" if stat.S_ISREG(mode) else "not a folder"
    try:
        names = sorted(os.listdir(p))
    except OSError as exc:
        return f"a folder ddp.data cannot list ({exc.strerror})"
    if not names:
        return None
    if HEADER not in names or not _regular(p / HEADER):
        return f"a folder without {HEADER}"
    others = [n for n in names if not OWN_NAME.fullmatch(n) or not _regular(p / n)]
    if others:
        shown = ", ".join(repr(n) for n in others[:3]) + (" ..." if len(others) > 3 else "")
        return f"a folder that also holds {shown}"
    return None


def _regular(path: Path) -> bool:
    """Whether ``path`` itself (not a link's target) is a regular file; a name that
    vanished meanwhile is not."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _empty_folder(path: Path) -> bool:
    """Whether ``path`` is a real folder (not a link) with nothing in it."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and not os.listdir(path)
    except OSError:
        return False


def _remove_own(folder: Path) -> None:
    """Delete the files ddp.data wrote in ``folder``, then the folder if that emptied it;
    anything else stays (and a note says so)."""
    with contextlib.suppress(OSError):
        for entry in list(os.scandir(folder)):
            if OWN_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    try:
        os.rmdir(folder)
    except FileNotFoundError:
        pass
    except OSError:
        log.warning("left %s in place: it holds files that ddp.data did not write", folder)


# ---- signals while a store is written ------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """A termination signal (SIGTERM, SIGHUP, SIGINT) arrived while a store was being
    written; the temporary store was removed on the way out. ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def redeliver(self) -> NoReturn:
        """End the process by the signal itself (its default action), as it would have
        ended without the cleanup: for callers with no one-line exit of their own."""
        signal.signal(self.signum, signal.SIG_DFL)
        os.kill(os.getpid(), self.signum)
        raise self  # only if the default action does not end the process


class _SignalGuard:
    """Turns SIGTERM, SIGHUP and SIGINT into :class:`Interrupted` while a writer is open.

    Their default action kills the process before any ``finally`` runs, which left the
    hidden temporary store behind (31 MB per killed preparation). Only signals whose
    handler is still the default are taken over (a caller's own handler, e.g. the
    Trainer's preemption watch, stays in charge), only from the main thread, and only
    while a writer is open. Inside :meth:`deferred` (publishing, cleaning up) a signal
    waits until the block ends, so it never lands between moving the old store aside
    and renaming the new one in; on :meth:`exit` a signal still waiting is sent again
    under the restored handlers, so it takes its usual effect once the store is whole.
    """

    NAMES = ("SIGTERM", "SIGHUP", "SIGINT")

    def __init__(self) -> None:
        self.depth = 0
        self.hold = 0
        self.pending: int | None = None
        self.old: dict[int, Any] = {}

    def enter(self) -> None:
        self.depth += 1
        if self.depth > 1 or threading.current_thread() is not threading.main_thread():
            return
        for name in self.NAMES:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            old = signal.getsignal(signum)
            if old in (signal.SIG_DFL, signal.default_int_handler):
                self.old[signum] = old
                signal.signal(signum, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.hold:
            self.pending = self.pending or signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self, deliver: bool = True) -> Iterator[None]:
        """Signals wait until the block ends; then, with ``deliver``, raise as usual."""
        self.hold += 1
        try:
            yield
        finally:
            self.hold -= 1
            if deliver and not self.hold and self.pending is not None:
                signum, self.pending = self.pending, None
                raise Interrupted(signum)

    def exit(self) -> None:
        self.depth -= 1
        if self.depth:
            return
        old, self.old = self.old, {}
        for signum, handler in old.items():
            signal.signal(signum, handler)
        pending, self.pending = self.pending, None
        if pending is not None and pending in old:
            os.kill(os.getpid(), pending)  # its usual effect, now that the store is whole


_GUARD = _SignalGuard()


class StoreWriteError(ConfigError):
    """The store could not be written where asked (full disk, no permission); nothing of
    it was left behind."""


class StoreWriter:
    """Builds a store from sequences of token ids, atomically.

    Use as a context manager: the store appears at ``out`` only when the block ends
    without an exception; otherwise the temporary directory is removed (also on
    SIGTERM, SIGHUP and SIGINT, and on a full disk, reported in one line). Sequences
    are appended in batches (:meth:`add_flat` takes an already flat token array plus
    lengths: the FASTA path's vectorised output) or one by one (:meth:`add`).

    ``overwrite`` replaces an existing store, only one that ddp.data wrote
    (:func:`foreign`); ``inputs`` are the files the store is made from, which the
    output may neither be nor contain. A store without tokens is never published.
    """

    def __init__(
        self,
        out: str | Path,
        tokenizer: str,
        vocab_size: int,
        source: str = "",
        overwrite: bool = False,
        extra: dict[str, Any] | None = None,
        inputs: Sequence[str | Path] = (),
    ) -> None:
        self.out = Path(out)
        self.overwrite = overwrite
        self._check_target(inputs)
        self.tokenizer, self.vocab_size, self.source = tokenizer, vocab_size, source
        self.extra = dict(extra or {})
        self.dtype = _dtype_for(vocab_size)
        self.n_seqs = 0
        self.n_tokens = 0
        self._closed = 0  # tokens that belong to sequences already ended
        self._tmp: Path | None = None
        self._fh: dict[str, Any] = {}

    def _check_target(self, inputs: Sequence[str | Path]) -> None:
        where = str(self.out)
        real_out = os.path.realpath(self.out)
        for src in inputs:
            real_src = os.path.realpath(src)
            holds = os.path.commonpath([real_out, real_src]) == real_out
            same = real_src == real_out
            with contextlib.suppress(OSError):
                same = same or os.path.samefile(self.out, src)  # a hard link
            if same or holds:
                raise ConfigError(
                    f"{where!r} {'is' if same else 'holds'} the input "
                    f"{str(src)!r}; allowed: an output path apart from the input"
                )
        if not os.path.lexists(self.out) or _empty_folder(self.out):
            return  # an empty folder (made for the output) holds nothing to lose
        if not self.overwrite:
            raise ConfigError(
                f"{where!r} exists; allowed: a new path, or --force to replace a token store"
            )
        self._check_replaceable()

    def _check_replaceable(self) -> None:
        reason = foreign(self.out)
        if reason is not None and reason != "gone":
            raise ConfigError(
                f"{str(self.out)!r} is {reason}, not a token store written by "
                "ddp.data; --force replaces only a token store (nothing was "
                "deleted); allowed: a new path or an existing token store"
            )

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """OSError of the writer's own I/O -> one line (ENOSPC says so)."""
        try:
            yield
        except OSError as exc:
            raise self._io_error(exc) from None

    def _io_error(self, exc: OSError) -> StoreWriteError:
        where = str(self.out)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreWriteError(
                f"{where!r}: no space left on device for the token store "
                f"({self.n_tokens:,} tokens written); its partial copy was "
                "removed; allowed: a filesystem with room"
            )
        return StoreWriteError(
            f"{where!r}: cannot write the token store ({exc.strerror}); nothing was left behind"
        )

    def __enter__(self) -> StoreWriter:
        _GUARD.enter()
        try:
            with self._writing():
                self.out.parent.mkdir(parents=True, exist_ok=True)
                with _GUARD.deferred():  # the folder exists only once _tmp names it
                    self._tmp = Path(
                        tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent)
                    )
                for name in FILES:
                    self._fh[name] = open(self._tmp / name, "wb")
                self._fh["offsets.bin"].write(np.zeros(1, np.int64).tobytes())
        except BaseException:
            with _GUARD.deferred(deliver=False):
                self._discard()
            _GUARD.exit()
            raise
        return self

    def add_tokens(self, tokens: np.ndarray) -> None:
        """Append tokens of sequences still open; :meth:`end_sequences` gives their lengths.

        The streaming FASTA reader writes a chunk's tokens before it knows where the
        last sequence of the chunk ends."""
        if len(tokens) and int(np.max(tokens)) >= self.vocab_size:
            raise ValueError(f"token id {int(np.max(tokens))} >= vocab_size {self.vocab_size}")
        with self._writing():
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
        with self._writing():
            self._fh["offsets.bin"].write(offsets.tobytes())
            self._fh["idhash.bin"].write(np.asarray(idhash, dtype=np.uint32).tobytes())
        self.n_seqs += len(lengths)

    def add_flat(
        self, tokens: np.ndarray, lengths: np.ndarray, idhash: np.ndarray | None = None
    ) -> None:
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

    def _discard(self) -> None:
        """Close and remove everything this writer made (never raises)."""
        for fh in self._fh.values():
            with contextlib.suppress(OSError):
                fh.close()  # a full disk fails the final flush too
        self._fh = {}
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            with _GUARD.deferred(deliver=False):  # a signal now waits until the end
                if exc_type is not None:
                    self._discard()
                    return
                try:
                    self._publish()
                except BaseException:
                    self._discard()
                    raise
        finally:
            _GUARD.exit()

    def _publish(self) -> None:
        assert self._tmp is not None
        with self._writing():
            for fh in self._fh.values():
                fh.close()
        if self._closed != self.n_tokens:  # tokens of an unfinished sequence: never publish
            raise ValueError(f"{self.n_tokens - self._closed} tokens belong to no sequence")
        if not self.n_tokens:
            raise ConfigError(
                f"{str(self.out)!r}: no tokens to store ({self.n_seqs:,} "
                "sequences, all empty); a token store holds at least one token"
            )
        with self._writing():
            header = {
                "format": FORMAT,
                "tokenizer": self.tokenizer,
                "vocab_size": self.vocab_size,
                "dtype": self.dtype.name,
                "n_seqs": self.n_seqs,
                "n_tokens": self.n_tokens,
                "bytes": {n: (self._tmp / n).stat().st_size for n in FILES},
                "source": self.source,
                **self.extra,
            }
            (self._tmp / HEADER).write_text(json.dumps(header, indent=1) + "\n")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self._tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide it from the group
            for name in (*FILES, HEADER):
                with open(self._tmp / name, "rb+") as fh:
                    os.fsync(fh.fileno())
            if self.overwrite and os.path.lexists(self.out):
                self._check_replaceable()  # again: it may have changed while we wrote
                old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
                try:
                    os.replace(self.out, old)  # --force: the old store goes once the new is whole
                except OSError:
                    os.rmdir(old)
                    raise
                try:
                    os.replace(self._tmp, self.out)
                except OSError:
                    os.replace(old, self.out)  # put the old store back rather than lose both
                    raise
                self._tmp = None
                _remove_own(old)
                return
            try:
                os.replace(self._tmp, self.out)
            except OSError:
                if not is_store(self.out):
                    raise
                # Another process (a second job on the same FASTA) published the same
                # store first: theirs is as good as ours.
                shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def write_store(
    out: str | Path,
    seqs: Iterable[Sequence[int]],
    tokenizer: str,
    vocab_size: int,
    ids: Iterable[str] | None = None,
) -> TokenStore:
    """Build a store from any iterable of token sequences (and optional ids); returns it."""
    with StoreWriter(out, tokenizer, vocab_size) as w:
        id_iter = iter(ids) if ids is not None else None
        for seq in seqs:
            w.add(seq, next(id_iter) if id_iter is not None else None)
    return TokenStore(out, tokenizer)
