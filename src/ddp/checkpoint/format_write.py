"""Writing checkpoints: the durable save (staged, then finished in the background),
each rank's own file, the write errors as one line, and the final export.

The order of a save is the format's promise (:mod:`ddp.checkpoint.format`): the digest
first, then the rank files, then the checkpoint file, then ``latest``, each durable
before the next, so a ``kill -9`` at any instant leaves ``latest`` naming a complete
checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import torch

from ddp.checkpoint.files import (
    _atomic_write,
    _digest_path,
    _Digesting,
    _Staged,
    atomic_save,
    atomic_write_text,
    fsync_dir,
)
from ddp.checkpoint.format import (
    model_state,
    prune,
    rank_dir,
    rank_file_name,
    remove_checkpoint,
    remove_stale_staging,
    step_path,
)
from ddp.checkpoint.layout import _RANK_HEADER, FORMAT_VERSION, LATEST


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
        # torch.save calls only write() and flush() on it
        torch.save({"format": FORMAT_VERSION, **state}, cast(IO[bytes], out))
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
