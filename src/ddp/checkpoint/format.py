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
import os
import pickle
import random
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ddp.checkpoint.checks import _show, check_fields
from ddp.checkpoint.files import (
    _atomic_write,
    _digest_path,
    _Digesting,
    _Staged,
    atomic_save,
    atomic_write_text,
    fsync_dir,
    read_regular,
    sha256_file,
)
from ddp.checkpoint.layout import (
    _RANK_HEADER,
    _STEP_RE,
    FORMAT_VERSION,
    LATEST,
    META,
    RANK_FILE_LIMIT,
)
from ddp.dist import unwrap

log = logging.getLogger("ddp")

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

class PendingSave:
    """A checkpoint whose save may still be running: the caller goes on training.

    ``finalize`` runs in a thread when ``background=True``: for a plain checkpoint the
    fsync, the rename into place, the ``latest`` update and pruning (its bytes are
    already written); for a sharded one also the wait for every rank's shards
    (``ddp.checkpoint.manager``). :meth:`wait` joins it and raises what it failed with (one
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
            raise save_error(directory, path.name, err) from None
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
                    raise save_error(directory, path.name, err) from None
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


def save_error(directory: Path, name: str, exc: OSError, rank: int | None = None) -> Exception:
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



def read_checkpoint(path: Path, ranks: bool = True) -> dict[str, Any]:
    """Load one checkpoint, checked; raises ValueError naming what is wrong with it.

    For a sharded checkpoint (a directory) this is its meta file, after every shard's
    digest was checked; ``"sharded"`` then names the directory the shards are read from.
    Every field it holds is checked (:func:`check_fields`): a crafted or damaged value
    is a line naming the field, never a traceback later in the run.

    ``ranks``: also read every rank file (:func:`read_rank_state`) and check the shards
    each one lists: what one process needs to trust a whole checkpoint. False leaves
    them to the ranks of a resumed run, each reading its own (``ddp.checkpoint.manager``), so
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


