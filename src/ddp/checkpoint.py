"""Atomic checkpoints, resume lookup and export for single-device inference.

A checkpoint is ``<dir>/step_<N>.pt`` plus ``step_<N>.pt.sha256``, the digest of its
bytes, and ``step_<N>.ranks/``: one small file per rank with that rank's own state (its
RNG streams; :func:`write_rank_state`); ``<dir>/latest`` names the newest complete one.
All are written through :func:`atomic_save` / :func:`atomic_write_text`
(temp file in the same directory, fsync, ``os.replace``, fsync of the directory),
and ``latest`` only moves after its checkpoint is durable, so a ``kill -9`` at any
instant leaves ``latest`` pointing at a complete file. Loading falls back to the
newest readable ``step_*.pt`` when the pointer is missing or its target is damaged.

A checkpoint is untrusted input (a shared directory, a file from elsewhere): it is
loaded with ``torch.load(weights_only=True)``, which builds tensors and plain
containers and refuses any pickled object that would run code, so the trainer stores
only such values (RNG states included, see :func:`rng_state`). The digest catches a
flipped byte, which torch's zip reader would load silently; ``latest`` may only name a
``step_*.pt`` file in the same directory, never a path elsewhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import math
import os
import pickle
import random
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ddp import _files
from ddp.dist import unwrap

log = logging.getLogger("ddp")

LATEST = "latest"
DIGEST_SUFFIX = ".sha256"
_STEP_RE = re.compile(r"^step_(\d+)(\.pt)?\Z")  # a file, or a sharded checkpoint's directory
META = "meta.pt"  # in a sharded checkpoint: everything but the shards (ddp.checkpointer)
FORMAT_VERSION = 3  # 2: sha256 sidecar, RNG states as plain values (weights_only loads)
# 3: each rank's state in its own rank file (``rank_files``), no gathered ``rng`` list
RANK_FILE_LIMIT = 1 << 20
"""At most this many bytes in one rank file (about 13 KB when sound: RNG states)."""
_RANK_HEADER = b"ddp-rank-state sha256="


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


class _Staged:
    """A file written under a temp name in its final directory, made visible by commit().

    Same directory, so ``os.replace`` is atomic; ``commit`` fsyncs the file, renames it
    and fsyncs the directory so the rename itself survives a crash. Every atomic write
    here (checkpoints, their digests, ``latest``, the export) goes through this class.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
        )
        self.fh = os.fdopen(fd, "wb")

    def commit(self, durable: bool = True) -> None:
        try:
            try:
                self.fh.flush()
                if durable:
                    os.fsync(self.fh.fileno())
            finally:
                self.fh.close()
            os.replace(self.tmp, self.path)
        except BaseException as exc:
            raise self.failed(exc) from None
        if durable:
            fsync_dir(self.path.parent)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)

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
        torch.save(obj, out)
        staged.fh.flush()
        atomic_write_text(out.sha.hexdigest() + "\n", _digest_path(path))
    except BaseException as exc:
        raise staged.failed(exc) from None
    staged.commit()


def atomic_write_text(text: str, path: str | Path, durable: bool = True) -> None:
    _atomic_write(Path(path), lambda fh: fh.write(text.encode()), durable)


# ---- RNG state -------------------------------------------------------------------------
def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, the accelerator)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        # Plain values, not an ndarray: a weights_only load needs no numpy globals.
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(gauss))
    except ImportError:  # pragma: no cover
        pass
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device is not None and device.type == "xpu":
        state["xpu"] = torch.xpu.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            name, keys, pos, has_gauss, gauss = state["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        except ImportError:  # pragma: no cover
            pass
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    elif device is not None and device.type == "xpu" and "xpu" in state:
        torch.xpu.set_rng_state(state["xpu"], device)


# ---- model state -----------------------------------------------------------------------
def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict of the unwrapped model: keys without ``module.``, loadable without DDP."""
    return unwrap(model).state_dict()


# ---- directory of checkpoints ----------------------------------------------------------
def step_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:09d}.pt"


def sharded_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:09d}"


def staging_path(path: Path) -> Path:
    """Where a sharded checkpoint's shards, or a checkpoint's rank files, are written
    before it is complete: a dot name that the resume lookup (:data:`_STEP_RE`) never
    takes for a checkpoint."""
    return path.with_name(f".{path.name}.tmp")


def rank_dir(checkpoint: str | Path) -> Path:
    """Where a checkpoint's rank files live: beside ``step_N.pt``, the directory
    ``step_N.ranks``; in a sharded checkpoint, its own directory (beside the shards)."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_suffix(".ranks") if checkpoint.suffix == ".pt" else checkpoint


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:06d}.pt"


_STAGING_RE = re.compile(r"^\.step_(\d+)(\.ranks)?\.tmp\Z")
_RANKS_DIR_RE = re.compile(r"^step_(\d+)\.ranks\Z")


def remove_stale_staging(directory: Path, before: int | None = None) -> None:
    """Delete staging directories left by a run killed mid-save, and checkpoint
    directories left half-deleted (:func:`remove_checkpoint`).

    Only while no save of this run is in flight (the directory lock keeps other runs out),
    or, with ``before``, only the staging directories of steps before it: other ranks may
    be writing their rank files for a later step while rank 0 finishes this one.
    """
    for pattern in (".step_*.tmp", ".step_*.old"):
        for stale in directory.glob(pattern):
            if not stale.is_dir() or stale.is_symlink():
                continue
            m = _STAGING_RE.match(stale.name)
            if before is not None and m and int(m.group(1)) >= before:
                continue
            remove_checkpoint(stale)


def _is_checkpoint(p: Path) -> bool:
    """A ``step_N.pt`` file, or a ``step_N`` directory holding its meta file."""
    if p.is_symlink():
        return False
    return p.is_file() if p.suffix == ".pt" else (p / META).is_file()


def list_checkpoints(directory: str | Path) -> list[Path]:
    """``step_*.pt`` files and sharded ``step_*`` directories, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in d.iterdir()
        if (m := _STEP_RE.match(p.name)) and _is_checkpoint(p)
    ]
    return [p for _, p in sorted(found)]


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file with its digest and rank files, or a sharded checkpoint's
    directory.

    A ``step_N`` directory is first renamed to a hidden ``.step_N.old``: a kill during
    the deletion would otherwise leave a ``step_N`` with some shards (or none) that
    pruning never removes once its meta file is gone; the hidden one is removed by
    :func:`remove_stale_staging`.
    """
    if path.is_dir() and not path.is_symlink():
        import shutil

        if _STEP_RE.match(path.name) or _RANKS_DIR_RE.match(path.name):
            trash = path.with_name(f".{path.name}.old")
            shutil.rmtree(trash, ignore_errors=True)
            try:
                os.replace(path, trash)
                path = trash
            except OSError:
                pass  # delete it in place
        shutil.rmtree(path, ignore_errors=True)
        return
    if path.suffix == ".pt":
        # Its rank files first: a kill now leaves a file without them, which the resume
        # skips and pruning removes, never rank files that no checkpoint names.
        ranks = rank_dir(path)
        if ranks.is_dir() and not ranks.is_symlink():
            remove_checkpoint(ranks)
        elif ranks.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                ranks.unlink()
    for gone in (path, _digest_path(path)):
        with contextlib.suppress(FileNotFoundError):
            gone.unlink()


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


class PendingSave:
    """A checkpoint whose save may still be running: the caller goes on training.

    ``finalize`` runs in a thread when ``background=True``: for a plain checkpoint the
    fsync, the rename into place, the ``latest`` update and pruning (its bytes are
    already written); for a sharded one also the wait for every rank's shards
    (``ddp.checkpointer``). :meth:`wait` joins it and raises what it failed with (one
    ConfigError line for a write error), once.
    """

    def __init__(self, path: Path, finalize: Callable[[], None], background: bool) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, args=(finalize,), name="ddp-checkpoint", daemon=False
            )
            self._thread.start()
        else:
            self._run(finalize)

    def _run(self, finalize: Callable[[], None]) -> None:
        try:
            finalize()
        except BaseException as exc:  # reported by wait()
            self._error = exc

    def wait(self, timeout: float | None = None) -> bool:
        """True once finished (raising its error, if any); False if still running."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return True


def save_checkpoint(
    state: dict[str, Any],
    directory: str | Path,
    step: int,
    keep_last: int = 2,
) -> Path:
    """Write ``step_<N>.pt`` durably, move ``latest`` to it and prune old ones; its path."""
    pending = begin_save(state, directory, step, keep_last, background=False)
    pending.wait()
    return pending.path


def begin_save(
    state: dict[str, Any],
    directory: str | Path,
    step: int,
    keep_last: int = 2,
    background: bool = False,
) -> PendingSave:
    """Serialise ``state`` to ``step_<N>.pt`` (digest computed as it is written), then
    finalize: digest file, fsync, rename, ``latest``, pruning. Call on one rank only.

    Only the serialisation (what a bare ``torch.save`` also pays) blocks the caller;
    with ``background=True`` the finalize runs in a thread (:class:`PendingSave`).
    ``latest`` moves only after the checkpoint file is durable.
    """
    return stage_save(state, directory, step).finish(keep_last, background)


def stage_save(state: dict[str, Any], directory: str | Path, step: int) -> StagedCheckpoint:
    """The first half of :func:`begin_save`: ``state`` serialised under a temp name, its
    digest computed; nothing visible yet. A write error is one ConfigError line."""
    directory = Path(directory)
    path = step_path(directory, step)
    staged = _Staged(path)
    out = _Digesting(staged.fh)
    try:
        torch.save({"format": FORMAT_VERSION, **state}, out)
        staged.fh.flush()  # a full disk shows here, in the caller, not in the thread
    except BaseException as exc:
        err = staged.failed(exc)
        if isinstance(err, OSError):
            raise _write_error(directory, path.name, err) from None
        raise err from None
    return StagedCheckpoint(path, staged, out.sha, step)


class StagedCheckpoint:
    """A checkpoint file serialised by :func:`stage_save`, made visible by :meth:`finish`
    (or dropped by :meth:`discard`): between the two, the caller may agree with the other
    ranks that their rank files are written."""

    def __init__(self, path: Path, staged: _Staged, sha: Any, step: int) -> None:
        self.path, self._staged, self._sha, self._step = path, staged, sha, step

    def discard(self) -> None:
        self._staged.discard()

    def finish(self, keep_last: int, background: bool, ranks: Path | None = None) -> PendingSave:
        """Finalize (in a thread with ``background``): digest file, fsync, rename,
        ``latest``, pruning. ``ranks``: the staging directory holding every rank's file
        (:func:`write_rank_state`), all durable already; it becomes ``step_<N>.ranks``
        just before the checkpoint file appears, so a visible checkpoint always has its
        rank files (a kill in between leaves neither, or rank files no resume reads)."""
        path, staged, directory = self.path, self._staged, self.path.parent

        def finalize() -> None:
            committed = False
            try:
                if ranks is not None:
                    remove_checkpoint(path)  # the same step from an older run, rank files too
                # The digest lands first: a checkpoint is never visible without one.
                atomic_write_text(self._sha.hexdigest() + "\n", _digest_path(path))
                if ranks is not None:
                    os.replace(ranks, rank_dir(path))
                    fsync_dir(directory)
                staged.commit()
                committed = True
                atomic_write_text(path.name + "\n", directory / LATEST)
            except BaseException as exc:
                if ranks is not None and not committed:
                    remove_checkpoint(ranks)
                    remove_checkpoint(rank_dir(path))
                err = staged.failed(exc)
                if isinstance(err, OSError):
                    raise _write_error(directory, path.name, err) from None
                raise err from None
            prune(directory, keep_last, path)
            for stale in directory.glob(".step_*.tmp"):  # left by a writer killed mid-save
                if str(stale) != staged.tmp and not stale.is_dir():
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
            remove_stale_staging(directory, before=self._step)

        return PendingSave(path, finalize, background)


def prune(directory: Path, keep_last: int, newest: Path) -> None:
    """Keep the ``keep_last`` newest checkpoints (never ``newest``)."""
    for old in list_checkpoints(directory)[:-keep_last]:
        if old != newest:
            remove_checkpoint(old)


def _write_error(directory: Path, name: str, exc: OSError, rank: int | None = None) -> Exception:
    """A failed write (full disk, quota, read-only) as one line; older checkpoints stay.

    Names the file that failed, relative to ``directory``, where the OSError says which
    (``name`` otherwise), and the rank where several write."""
    from ddp.errors import ConfigError

    if exc.filename:
        with contextlib.suppress(ValueError):
            name = str(Path(os.fsdecode(exc.filename)).relative_to(directory))
    if rank is not None:
        name += f" (rank {rank})"
    return ConfigError(
        f"checkpoint.dir {str(directory)!r}: writing {name} failed: "
        f"{exc.strerror or exc}; the earlier checkpoints are kept"
    )


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def read_checkpoint(path: Path, ranks: bool = True) -> dict[str, Any]:
    """Load one checkpoint, checked; raises ValueError naming what is wrong with it.

    For a sharded checkpoint (a directory) this is its meta file, after every shard's
    digest was checked; ``"sharded"`` then names the directory the shards are read from.
    Every field it holds is checked (:func:`check_fields`): a crafted or damaged value
    is a line naming the field, never a traceback later in the run.

    ``ranks``: also read every rank file (:func:`read_rank_state`) and check the shards
    each one lists: what one process needs to trust a whole checkpoint. False leaves
    them to the ranks of a resumed run, each reading its own (``ddp.checkpointer``), so
    no process reads W files.
    """
    if path.is_dir() and not path.is_symlink():
        obj = read_checkpoint(path / META, ranks=False)
        if not obj.get("shards"):
            raise ValueError("lists no shards")
        check_shards(path, obj["shards"])
        if ranks and obj.get("rank_files"):
            for rank in range(obj.get("world_size", 1)):  # stops at the first missing file
                check_shards(path, read_rank_state(path, rank, obj).get("rank_shards") or {})
        obj["sharded"] = str(path)
        return obj
    if path.is_symlink():
        raise ValueError("is a symbolic link; checkpoints are plain files")
    data = read_regular(path, None)
    digest = _digest_path(path)
    try:
        expected: str | None = read_regular(digest).decode("ascii", "replace").strip()
    except ValueError as exc:
        if os.path.lexists(digest):
            raise ValueError(f"has a digest file {digest.name} that {exc}") from None
        expected = None
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"does not match its digest {digest.name} (damaged)")
    obj = _load_bytes(data)
    if "sharded" in obj:  # set by the loader, after it checked that directory's shards
        raise ValueError("names a shard directory itself ('sharded'); only the loader does")
    check_fields(obj)
    if obj["format"] >= 2 and expected is None:
        raise ValueError(f"has no digest file {digest.name}")
    if ranks and obj.get("rank_files") and path.name != META:
        for rank in range(obj.get("world_size", 1)):  # stops at the first missing file
            read_rank_state(path, rank, obj)
    return obj


def _load_bytes(data: bytes) -> dict[str, Any]:
    """A checkpoint's (or rank file's) payload, loaded the safe way; ValueError if it
    holds anything but tensors and plain values, or is no dict that ddp writes."""
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # what weights_only refuses to build
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"holds objects that a safe load refuses ({first[:200]})") from None
    except Exception as exc:  # a damaged or foreign file
        raise ValueError(f"is not a loadable checkpoint ({type(exc).__name__})") from None
    if not isinstance(obj, dict) or "format" not in obj or "global_step" not in obj:
        raise ValueError("is not a checkpoint written by ddp")
    return obj


def check_shards(directory: Path, digests: dict[str, str]) -> None:
    """ValueError naming the first of ``digests`` (shard file name -> sha256) that is
    missing from ``directory`` or whose bytes do not match."""
    for name, digest in digests.items():
        shard = directory / name
        if shard.is_symlink() or not shard.is_file():
            raise ValueError(f"misses its shard {name}")
        if sha256_file(shard) != digest:
            raise ValueError(f"has a damaged shard {name} (digest mismatch)")


# ---- each rank's own state -----------------------------------------------------------------
#: What a rank file must hold (:func:`write_rank_state`).
RANK_FIELDS = ("format", "global_step", "world_size", "rank", "rank_rng")


def write_rank_state(directory: str | Path, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's own state into ``directory/rank_<R>.pt``, atomically and durably
    (temp file, fsync, rename, fsync of the directory). Every rank writes its own file
    and reads only its own on resume: no rank receives or parses the others' states,
    so neither the bytes a save moves nor any file grows with the number of ranks.

    The file is one line ``ddp-rank-state sha256=<hex>`` and the ``torch.save`` bytes it
    is the digest of: a flipped byte is caught as in a checkpoint file, without a second
    file per rank (at 100k ranks, a digest file each would double the files created in
    one directory at every save)."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT_VERSION, **state, "rank": rank}, buf)
    data = buf.getvalue()
    header = _RANK_HEADER + hashlib.sha256(data).hexdigest().encode() + b"\n"
    path = Path(directory) / rank_file_name(rank)
    _atomic_write(path, lambda fh: fh.write(header + data))
    return path


def read_rank_state(checkpoint: str | Path, rank: int, saved: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s file of ``checkpoint`` (its ``step_N.pt`` or sharded directory),
    checked; ValueError naming the file and what is wrong with it.

    It is untrusted input like the checkpoint: a regular file (never a pipe or a link,
    at most :data:`RANK_FILE_LIMIT` bytes), its digest line matching, loaded with
    ``weights_only``, every field checked (:func:`check_fields`, RNG states tried on
    throwaway generators), and its step, world size and rank those of ``saved`` (the
    checkpoint's own fields) and of its name: a rank file copied from another checkpoint
    or another rank is refused."""
    path = rank_dir(checkpoint) / rank_file_name(rank)
    where = f"{path.parent.name}/{path.name}"
    if path.parent.is_symlink():  # it could lead anywhere, as a checkpoint file could
        raise ValueError(f"has a rank directory {path.parent.name} that is a symbolic link; "
                         "allowed: a directory")  # fmt: skip
    try:
        data = read_regular(path, RANK_FILE_LIMIT)
    except ValueError as exc:
        if not os.path.lexists(path):
            raise ValueError(f"misses its rank file {where}") from None
        raise ValueError(f"has a rank file {where} that {exc}") from None
    head, newline, payload = data.partition(b"\n")
    if not newline or not head.startswith(_RANK_HEADER):
        raise ValueError(f"has a rank file {where} that is not one ddp writes (no digest "
                         "line)")  # fmt: skip
    if hashlib.sha256(payload).hexdigest().encode() != head[len(_RANK_HEADER):]:
        raise ValueError(f"has a damaged rank file {where} (digest mismatch)")
    try:
        obj = _load_bytes(payload)
        check_fields(obj, required=RANK_FIELDS)
        for key, want in (("global_step", saved.get("global_step")),
                          ("world_size", saved.get("world_size")), ("rank", rank)):  # fmt: skip
            if obj[key] != want:
                raise ValueError(f"has a bad {key}: {_show(obj[key])}; allowed: {want!r}, "
                                 "the checkpoint's")  # fmt: skip
        for name in obj.get("rank_shards") or {}:
            if not re.fullmatch(rf"__{rank}_\d+\.distcp", name):
                raise ValueError(f"has a bad rank_shards: {name!r}; allowed: this rank's "
                                 f"shards (__{rank}_N.distcp)")  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"has a rank file {where} that {exc}") from None
    return obj


#: What a sharded checkpoint's shard files may be called: torch.distributed.checkpoint's
#: per-rank data files and its metadata file (nothing with a path in it).
_SHARD_RE = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)\Z")


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


# ---- what a loaded checkpoint may hold ---------------------------------------------------
_I64 = 1 << 63


def _count(low: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v < _I64


def _is_tensor_map(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in v.items()
    )


def _is_optimizer(v: Any) -> bool:
    return (isinstance(v, dict) and isinstance(v.get("state"), dict)
            and isinstance(v.get("param_groups"), list)
            and all(isinstance(g, dict) for g in v["param_groups"]))  # fmt: skip


def _is_plain_tree(v: Any) -> bool:
    """A mapping of strings to plain values (null, booleans, numbers, strings) and lists
    and mappings of them: what ``TrainConfig.to_dict`` makes, nothing a comparison with
    this run's config could trip on (a tensor)."""
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_plain_tree(x) for k, x in v.items())
    if isinstance(v, list | tuple):
        return all(_is_plain_tree(x) for x in v)
    return v is None or type(v) in (bool, int, float, str)


def _is_shard_list(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and _SHARD_RE.match(k) and isinstance(d, str)
        and re.fullmatch(r"[0-9a-f]{64}", d) for k, d in v.items()
    )  # fmt: skip


#: Every field a checkpoint may hold: (its check, what is allowed). Checked wherever one
#: is loaded (:func:`check_fields`), so no crafted value reaches the trainer.
FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format": (lambda v: type(v) is int and 1 <= v <= FORMAT_VERSION,
               f"an integer from 1 to {FORMAT_VERSION} (a newer one needs a newer ddp)"),
    "global_step": (_count(0), "an integer >= 0"),
    "phase": (_count(0), "an integer >= 0"),
    "epoch": (_count(0), "an integer >= 0"),
    "batches_in_epoch": (_count(0), "an integer >= 0"),
    "samples_in_epoch": (lambda v: v is None or _count(0)(v), "an integer >= 0 or null"),
    "phase_start_step": (_count(0), "an integer >= 0"),
    "world_size": (_count(1), "an integer >= 1"),
    "rng": (lambda v: isinstance(v, list), "a list of every rank's RNG states"),
    "rank_files": (lambda v: type(v) is bool, "true or false"),
    "rank": (_count(0), "an integer >= 0"),
    "rank_rng": (lambda v: v is None or isinstance(v, dict), "a mapping of one rank's RNG "
                 "states"),
    "rank_shards": (_is_shard_list, "a mapping of shard file names to sha256 digests"),
    "config": (lambda v: isinstance(v, dict) and _is_plain_tree(v),
               "a mapping of plain values (the run's config)"),
    "scheduler": (lambda v: isinstance(v, dict), "a mapping (a scheduler's state)"),
    "scaler": (lambda v: v is None or isinstance(v, dict), "a mapping or null"),
    "model": (_is_tensor_map, "a mapping of parameter names to tensors"),
    "optimizer": (_is_optimizer, "an optimizer's state (state and param_groups)"),
    "shards": (_is_shard_list, "a mapping of shard file names to sha256 digests"),
    "optim_other": (lambda v: v is None or isinstance(v, dict), "a mapping or null"),
    "param_groups": (lambda v: v is None or (isinstance(v, list) and all(
        isinstance(g, dict) for g in v)), "a list of mappings or null"),
}  # fmt: skip

#: What a checkpoint must hold for the trainer to resume from it.
TRAINER_FIELDS = ("global_step", "phase", "epoch", "scheduler")


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else (
        f"a {value.dtype} tensor of shape {tuple(value.shape)}")
    return text if len(text) <= 60 else text[:57] + "..."


def check_fields(obj: dict[str, Any], required: tuple[str, ...] = ()) -> None:
    """ValueError naming the first field of ``obj`` that is missing (of ``required``) or
    of the wrong type or range (:data:`FIELDS`), RNG states included. A checkpoint is
    untrusted input: a step that is a string, negative, NaN or a list would otherwise
    surface as a traceback far from its cause, or as a silently wrong run."""
    for name in required:
        if name not in obj:
            raise ValueError(f"misses the field {name!r}")
    if "epoch" in required and obj.get("samples_in_epoch") is None:
        if "batches_in_epoch" not in obj:
            raise ValueError("misses the field 'samples_in_epoch'")
    for name, (ok, allowed) in FIELDS.items():
        if name in obj and not ok(obj[name]):
            raise ValueError(f"has a bad {name}: {_show(obj[name])}; allowed: {allowed}")
    if obj.get("phase_start_step", 0) > obj.get("global_step", _I64):
        raise ValueError(f"has a bad phase_start_step: {obj['phase_start_step']} is after "
                         f"its global_step {obj['global_step']}")  # fmt: skip
    if obj.get("rank", -1) >= obj.get("world_size", _I64):
        raise ValueError(f"has a bad rank: {obj['rank']} is not below its world_size "
                         f"{obj['world_size']}")  # fmt: skip
    for i, state in enumerate(obj.get("rng") or []):  # written before rank files
        check_rng_state(state, f"rng[{i}]")
    if obj.get("rank_rng") is not None:
        check_rng_state(obj["rank_rng"], "rank_rng")


def check_rng_state(state: Any, name: str = "rng") -> None:
    """ValueError unless ``state`` is one rank's RNG states as :func:`rng_state` makes
    them: each is tried on a throwaway generator, never on this process's own."""
    if not isinstance(state, dict) or "python" not in state or "torch" not in state:
        raise ValueError(f"has a bad {name}: {_show(state)}; allowed: a mapping with the "
                         "python and torch RNG states")  # fmt: skip

    def python(v: Any) -> None:
        random.Random().setstate(v)

    def torch_cpu(v: Any) -> None:
        torch.Generator().set_state(v)

    def numpy(v: Any) -> None:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = v
        if not (isinstance(gauss, float) and math.isfinite(gauss)):
            raise ValueError(gauss)
        np.random.RandomState().set_state(
            (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))

    def device(v: Any) -> None:
        if not (isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1):
            raise ValueError(v)

    checks = {"python": python, "torch": torch_cpu, "numpy": numpy, "cuda": device,
              "xpu": device}  # fmt: skip
    for key, value in state.items():
        check = checks.get(key)
        try:
            if check is None:
                raise ValueError(key)
            check(value)
        except Exception:  # what each generator says of a state it cannot take
            raise ValueError(f"has a bad {name}.{key}: {_show(value)}; allowed: the state "
                             f"that ddp saves for this generator") from None  # fmt: skip


def check_same_model(saved: dict[str, tuple[int, ...]], own: dict[str, tuple[int, ...]],
                     path: str | Path) -> None:  # fmt: skip
    """ConfigError naming the first parameter whose name or shape differs between a
    checkpoint (``saved``: name -> shape) and this model (``own``), with both shapes: one
    line for a plain and a sharded checkpoint alike, not torch's 40 (or DCP's traceback).
    """
    from ddp.errors import ConfigError

    missing = sorted(set(own) - set(saved))
    extra = sorted(set(saved) - set(own))
    shapes = [k for k in own if k in saved and tuple(own[k]) != tuple(saved[k])]
    if not (missing or extra or shapes):
        return
    if shapes:
        k = shapes[0]
        what = f"{k!r} is {tuple(saved[k])} in the checkpoint and {tuple(own[k])} in this model"
    else:
        what = f"keys missing {missing[:3]}, unexpected {extra[:3]}"
    raise ConfigError(
        f"checkpoint {str(path)!r} was saved from a different model ({what}); allowed: the "
        "same model settings, or a fresh checkpoint.dir / checkpoint.resume=none"
    )


def check_like(saved: Any, live: Any, name: str) -> None:
    """ValueError naming the first value of ``saved`` (a state from a checkpoint) whose
    kind differs from ``live`` (the same object's state in this run): a mapping's keys
    present in both, a list's length, numbers (finite), strings, booleans, tensors'
    shapes. Keys that this run's object lacks are the caller's to drop."""
    def bad(allowed: str) -> ValueError:
        return ValueError(f"has a bad {name}: {_show(saved)}; allowed: {allowed}")

    if isinstance(live, dict):
        if not isinstance(saved, dict):
            raise bad("a mapping")
        for key in saved.keys() & live.keys():
            check_like(saved[key], live[key], f"{name}.{key}")
    elif isinstance(live, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(live):
            raise bad(f"a list of {len(live)}")
        for i, (a, b) in enumerate(zip(saved, live, strict=True)):
            check_like(a, b, f"{name}[{i}]")
    elif isinstance(live, bool):
        if type(saved) is not bool:
            raise bad("true or false")
    elif isinstance(live, int | float):
        if type(saved) not in (int, float) or not math.isfinite(saved) or (
            type(live) is int and type(saved) is not int
        ):
            raise bad("an integer" if type(live) is int else "a finite number")
    elif isinstance(live, str):
        if not isinstance(saved, str):
            raise bad("a string")
    elif isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != live.shape:
            raise bad(f"a tensor of shape {tuple(live.shape)}")
    elif live is None:
        if saved is not None and type(saved) not in (bool, int, float, str):
            raise bad("a plain value or null")


def _readable(path: Path, ranks: bool = True) -> dict[str, Any] | None:
    try:
        return read_checkpoint(path, ranks)
    except ValueError as exc:  # damaged, foreign or crafted: skip it, never crash resume
        log.warning("checkpoint %s %s; trying an older one", path, exc)
        return None


def find_latest(directory: str | Path) -> Path | None:
    """Path that ``latest`` names, if that file exists, else the newest ``step_*.pt``."""
    directory = Path(directory)
    pointer = directory / LATEST
    try:
        name = read_regular(pointer).decode("utf-8", "replace").strip()
    except ValueError as exc:
        if os.path.lexists(pointer):
            log.warning("%s %s; ignored", pointer, exc)
        name = ""
    # Only a checkpoint name in this directory: never an absolute path, '..' or a link.
    if _STEP_RE.match(name) and _is_checkpoint(directory / name):
        return directory / name
    elif name:
        log.warning("%s names %r, not a checkpoint of this directory; ignored", pointer, name)
    found = list_checkpoints(directory)
    return found[-1] if found else None


def readable_checkpoints(
    directory: str | Path, ranks: bool = True
) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The valid checkpoints in ``directory`` with their contents, the one ``latest``
    names first, then the others newest first; each damaged one is skipped with a
    warning. ``ranks``: as for :func:`read_checkpoint`."""
    directory = Path(directory)
    first = find_latest(directory)
    candidates = [first] if first else []
    candidates += [p for p in reversed(list_checkpoints(directory)) if p != first]
    for path in candidates:
        obj = _readable(path, ranks)
        if obj is not None:
            yield path, obj


def load_latest(directory: str | Path, ranks: bool = True) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest valid checkpoint in ``directory``; None when there is none."""
    return next(readable_checkpoints(directory, ranks), None)


def load_checkpoint(
    path: str | Path, verify_shards: bool = True, ranks: bool = True
) -> dict[str, Any]:
    """Load the checkpoint a user named; any problem is one ConfigError line.

    ``verify_shards=False`` reads a sharded checkpoint's meta file only (the other ranks,
    once rank 0 has checked every shard); ``ranks``: as for :func:`read_checkpoint`."""
    try:
        p = Path(path)
        if not verify_shards and p.is_dir() and not p.is_symlink():
            obj = read_checkpoint(p / META, ranks=False)
            obj["sharded"] = str(p)
            return obj
        return read_checkpoint(p, ranks=ranks and verify_shards)
    except ValueError as exc:
        from ddp.errors import ConfigError

        raise ConfigError(f"checkpoint.resume: {str(path)!r} {exc}") from None


def export_final(
    model: torch.nn.Module,
    directory: str | Path,
    config_yaml: str,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``<dir>/final/model.pt`` (plain CPU state_dict) and ``final/config.yaml``.

    The state dict has no ``module.`` prefix and only tensors, so
    ``torch.load(path, weights_only=True)`` loads it into the bare model class. A
    sharded model's full ``state`` is gathered by the caller (a collective).
    """
    final = Path(directory) / "final"
    source = model_state(model) if state is None else state
    state = {k: v.detach().to("cpu").clone() for k, v in source.items()}
    path = final / "model.pt"
    atomic_save(state, path)
    atomic_write_text(config_yaml, final / "config.yaml")
    return path


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


# ---- one live run per directory ----------------------------------------------------------
LOCK = ".ddp-lock"
"""Not ``.lock``: that is ``hpc``'s flock file in a run directory, and a checkpoint.dir
may be the run directory itself (``checkpoint.dir: .`` under ``hpc submit``). Sharing it
would find hpc's empty file where a lock belongs, and each heartbeat (a new file) would
give hpc's flock holders different files."""
LOCK_REFRESH_S = 60.0
"""How often an owner beats (rewrites its lock with the next heartbeat count)."""
LOCK_STALE_BEATS = 3
"""Heartbeats an owner on another machine may miss before its lock is taken over."""
_PID_MAX = 1 << 31


def _read_small(path: str) -> str | None:
    """A kernel file of this machine (``/proc``), None where there is none."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read(4096).strip()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc/PID/stat`` field
    22); None when it does not exist (or there is no ``/proc``). With the pid and the
    boot id it names one process for good: a pid reused later has another start time."""
    stat_line = _read_small(f"/proc/{pid}/stat")
    if not stat_line or ")" not in stat_line:
        return None
    fields = stat_line.rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


class DirLock:
    """``<dir>/.ddp-lock``: which process owns ``dir``, in terms no clock can fake.

    Two runs on one checkpoint directory (two ``sbatch`` of the same script) would resume
    each other's checkpoints and overwrite each other's files; the second one stops with
    one line naming the owner instead. The lock records host, boot id
    (``/proc/sys/kernel/random/boot_id``), pid namespace, pid and the process's start time,
    plus a heartbeat counter that the owner bumps every :data:`LOCK_REFRESH_S` from a
    daemon thread. Whether the owner lives is decided, in this order:

    - same host, boot and pid namespace: by its pid being alive with the same start time
      (exact: a dead owner frees the lock at once, a reused pid does not hold it, and a
      live owner keeps it whatever its mtime says);
    - a requeue of the same SLURM job (same job id, another restart count) takes it back;
      the same host after a reboot (another boot id) finds it free;
    - another machine: by its heartbeat counter moving while this run watches on its own
      monotonic clock, for at most :data:`LOCK_STALE_BEATS` of the owner's intervals. An
      mtime is never compared with this host's clock (two hosts' clocks may disagree by
      hours): a lock whose mtime is as fresh as a file made now in the same directory
      (stamped by the same file system) is live at once; any other is watched.

    A lock file that is empty or unreadable is a run writing it this moment, or damaged:
    never free; it, and a lock path that is not a regular file, stop the run with one
    line. The file is written whole before it appears (a temp file, then ``link``), so a
    sound run never shows an empty one.
    """

    REFRESH_S = LOCK_REFRESH_S

    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        self.path = path
        self.info = info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="ddp-lock", daemon=True)
        self._thread.start()

    # ---- who I am -------------------------------------------------------------------------
    @classmethod
    def owner(cls) -> dict[str, Any]:
        """This process's identity as its lock records it (heartbeat 0)."""
        import socket
        import time

        pidns = None
        with contextlib.suppress(OSError):
            pidns = os.readlink("/proc/self/ns/pid")
        return {
            "host": socket.gethostname(),
            "boot": _read_small("/proc/sys/kernel/random/boot_id"),
            "pidns": pidns,
            "pid": os.getpid(),
            "start": process_start(os.getpid()),
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID"),
            "restart": os.environ.get("SLURM_RESTART_COUNT", "0"),  # bumped by each requeue
            "started": time.time(),  # for people reading the file; no decision uses it
            "interval": float(cls.REFRESH_S),
            "beat": 0,
        }

    @staticmethod
    def _same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return all(a.get(k) == b.get(k) for k in ("host", "boot", "pidns", "pid", "start"))

    # ---- taking it ------------------------------------------------------------------------
    @classmethod
    def acquire(cls, directory: str | Path) -> DirLock:
        """Take the lock or raise ConfigError naming the live owner or what is wrong."""
        from ddp.errors import ConfigError

        directory = Path(directory)
        path = directory / LOCK
        where = f"checkpoint.dir {str(directory)!r}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"{where} is not a directory; allowed: a directory, or a "
                              "path where one can be made") from None  # fmt: skip
        except OSError as exc:
            raise ConfigError(f"{where}: cannot write there ({exc.strerror or exc}); "
                              "allowed: a writable directory") from None  # fmt: skip
        me = cls.owner()
        for _ in range(5):
            try:
                _write_new(path, me)
                return cls(path, me)
            except FileExistsError:
                pass
            except OSError as exc:
                raise ConfigError(f"{where}: cannot write there ({exc.strerror or exc}); "
                                  "allowed: a writable directory") from None  # fmt: skip
            try:
                seen = cls._look(path)
            except ValueError as exc:
                raise ConfigError(
                    f"{where}: its lock {str(path)!r} {exc}; delete it if no run uses "
                    "this directory"
                ) from None
            if seen is None:
                continue  # gone between the two steps: try again
            other, key = seen
            why = cls._stale(other, key, me, path)
            if why is None:
                raise ConfigError(
                    f"{where} is in use by another run (host {other.get('host')}, pid "
                    f"{other.get('pid')}, job {other.get('job') or '-'}); give this run its "
                    f"own checkpoint.dir, or delete {str(path)!r} if that run is gone"
                )
            log.warning("taking over %s: %s", path, why)
            try:
                _remove_if_unchanged(path, key)
            except OSError as exc:
                raise ConfigError(f"{where}: cannot take over its stale lock {str(path)!r} "
                                  f"({exc.strerror or exc}); allowed: a writable "
                                  "directory") from None  # fmt: skip
        raise ConfigError(f"{where}: the lock {LOCK} keeps changing (runs starting at once); "
                          "allowed: one run per checkpoint.dir")  # fmt: skip

    @staticmethod
    def _look(path: Path) -> tuple[dict[str, Any], tuple[Any, ...]] | None:
        """(the owner it names, what changes with each heartbeat), None if it is gone.

        ValueError for a lock that is no lock: not a regular file, empty after a short
        wait for its writer, or not what a run writes."""
        import time

        for attempt in range(6):
            try:
                data, info = _open_regular(path, SMALL_FILE)
            except ValueError:
                if not os.path.lexists(path):
                    return None
                raise
            if data.strip() or attempt == 5:
                break
            time.sleep(0.05)  # a writer of an older version, between create and write
        if not data.strip():
            raise ValueError("is empty: a run is writing it this moment, or it is damaged")
        owner = _parse_lock(data)
        return owner, (info.st_ino, info.st_mtime_ns, info.st_size, owner.get("beat"))

    @classmethod
    def _stale(cls, other: dict[str, Any], key: tuple[Any, ...], me: dict[str, Any],
               path: Path) -> str | None:  # fmt: skip
        """Why the lock belongs to no live run, or None when it may."""
        pid = other["pid"]
        here = other["host"] == me["host"]
        if here and me["boot"] and other.get("boot") == me["boot"] and (
            other.get("pidns") == me["pidns"]
        ):
            start = process_start(pid)
            if start is None:
                return f"pid {pid} is gone"
            if other.get("start") is not None and other["start"] != start:
                return f"pid {pid} is another process now (it started at another time)"
            return None
        if other.get("job") and other.get("job") == me["job"]:
            if other.get("restart") != me["restart"]:
                return f"the same job {me['job']} restarted (requeue)"
        if here and me["boot"] and other.get("boot") and other["boot"] != me["boot"]:
            return "this host rebooted since"
        if here and other.get("boot") is None:  # written by an older version: its pid only
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return f"pid {pid} is gone"
            except PermissionError:
                pass
        return cls._watch(other, key, path)

    @staticmethod
    def _watch(other: dict[str, Any], key: tuple[Any, ...], path: Path) -> str | None:
        """An owner on another machine: live if its lock changes (a heartbeat) within
        LOCK_STALE_BEATS of its intervals, measured on this host's monotonic clock."""
        import time

        interval = other.get("interval") or LOCK_REFRESH_S
        interval = min(max(float(interval), 0.001), LOCK_REFRESH_S)
        window = LOCK_STALE_BEATS * interval
        made = _fresh_mtime(path.parent)
        if made is not None and abs(made - key[1]) <= window * 1e9:
            return None  # beat as recently as the file system's own clock can tell
        log.warning("%s: owner pid %s on host %s; waiting up to %.0f s for its heartbeat",
                    path, other["pid"], other["host"], window)  # fmt: skip
        deadline = time.monotonic() + window
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, interval / 4, 1.0))
            try:
                now = DirLock._look(path)
            except ValueError:
                return None  # changed into something else: not ours to judge now
            if now is None or now[1] != key:
                return None  # it beat (or went): live, or someone else's now
        return f"no heartbeat from host {other['host']} for {window:.0f} s"

    # ---- holding and releasing ------------------------------------------------------------
    def _refresh(self) -> None:
        while not self._stop.wait(float(self.info["interval"])):
            if not self._beat():
                return

    def _beat(self) -> bool:
        """Bump the heartbeat if the lock is still this run's; False once it is not."""
        try:
            seen = self._look(self.path)
        except ValueError as exc:
            if os.path.lexists(self.path):
                log.error("%s %s: this run no longer holds its checkpoint directory",
                          self.path, exc)  # fmt: skip
                return False
            seen = None
        if seen is not None and not self._same_process(seen[0], self.info):
            log.error("%s now names another run (host %s, pid %s): this run no longer "
                      "holds its checkpoint directory", self.path, seen[0].get("host"),
                      seen[0].get("pid"))  # fmt: skip
            return False
        self.info = {**self.info, "beat": int(self.info["beat"]) + 1}
        try:
            if seen is None:  # deleted by hand while this run lives: taken again
                _write_new(self.path, self.info)
            else:
                _write_replace(self.path, self.info)
        except FileExistsError:
            return self._beat()
        except OSError as exc:  # a full disk: the next beat tries again
            log.warning("cannot refresh %s (%s)", self.path, exc.strerror or exc)
        return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(30)
        try:
            seen = self._look(self.path)
        except ValueError:
            return
        if seen is not None and self._same_process(seen[0], self.info):
            with contextlib.suppress(OSError):
                self.path.unlink()


def _parse_lock(data: bytes) -> dict[str, Any]:
    """The owner a lock names, checked field by field (it is untrusted input)."""
    import json

    try:
        info = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("is damaged (not the JSON a run writes)") from None
    if not isinstance(info, dict):
        raise ValueError("is damaged (not the JSON object a run writes)")

    def bad(field: str, allowed: str) -> ValueError:
        return ValueError(f"is damaged ({field} {info.get(field)!r}; allowed: {allowed})")

    if not isinstance(info.get("host"), str):
        raise bad("host", "a host name")
    pid = info.get("pid")
    if type(pid) is not int or not 0 < pid < _PID_MAX:
        raise bad("pid", "a process id")
    for field in ("boot", "pidns", "job"):
        if info.get(field) is not None and not isinstance(info[field], str):
            raise bad(field, "a string or null")
    for field in ("start", "beat"):
        v = info.get(field)
        if v is not None and (type(v) is not int or v < 0):
            raise bad(field, "an integer >= 0 or null")
    v = info.get("interval")
    if v is not None and (type(v) not in (int, float) or not 0 < v < float("inf")):
        raise bad("interval", "seconds > 0")
    return info


def _write_new(path: Path, info: dict[str, Any]) -> None:
    """Make ``path`` hold ``info``, whole from the moment it exists; FileExistsError if
    it exists. A temp file is written, then hard-linked to ``path`` (atomic, fails on an
    existing name); where links are not supported, ``O_EXCL`` create and write."""
    import errno
    import json

    text = (json.dumps(info) + "\n").encode()
    fd, tmp = tempfile.mkstemp(prefix=f"{LOCK}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text)
        try:
            os.link(tmp, path)
            return
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text)
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def _write_replace(path: Path, info: dict[str, Any]) -> None:
    """Replace ``path`` with ``info`` atomically (a heartbeat)."""
    import json

    _atomic_write(path, lambda fh: fh.write((json.dumps(info) + "\n").encode()), durable=False)


def _remove_if_unchanged(path: Path, key: tuple[Any, ...]) -> None:
    """Delete the stale lock judged as ``key``, and only it.

    Two runs may judge the same stale lock at once; the first replaces it with its own.
    A plain unlink by the second would delete that live lock. So the lock is renamed
    away first (atomic), and put back if what was renamed is not the one judged. (A third
    run creating its lock in the instant between the two could still win against the
    first; the first's heartbeat then finds another owner and says so.)"""
    import uuid

    trash = path.with_name(f"{LOCK}.{uuid.uuid4().hex}.stale")
    try:
        info = os.stat(path, follow_symlinks=False)
        if (info.st_ino, info.st_mtime_ns, info.st_size) != key[:3]:
            return  # replaced already: judged again on the next round
        os.rename(path, trash)
    except FileNotFoundError:
        return
    try:
        info = os.stat(trash)
        if (info.st_ino, info.st_mtime_ns, info.st_size) != key[:3]:
            with contextlib.suppress(FileExistsError):
                os.link(trash, path)  # someone's live lock: back where it was
    finally:
        with contextlib.suppress(OSError):
            os.unlink(trash)


def _fresh_mtime(directory: Path) -> int | None:
    """The mtime (ns) a file made now in ``directory`` gets: the file system's clock,
    the one that stamped the lock's mtime; None where no file can be made."""
    try:
        with tempfile.NamedTemporaryFile(prefix=f"{LOCK}.", suffix=".probe", dir=directory) as fh:
            return os.fstat(fh.fileno()).st_mtime_ns
    except OSError:
        return None
