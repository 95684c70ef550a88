"""The checkpoint format: what a checkpoint directory holds, and its names.

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

This module holds the names (``step_path``, ``rank_dir``, ...), the listing, removal and
pruning of checkpoints, and the RNG and model state a checkpoint stores; writing is
:mod:`ddp.checkpoint.format_write`, reading and checking :mod:`ddp.checkpoint.format_read`.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from pathlib import Path
from typing import Any, cast

import torch

from ddp.checkpoint.files import _digest_path
from ddp.checkpoint.layout import _STEP_RE, META
from ddp.dist import unwrap


# ---- RNG state -------------------------------------------------------------------------
def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, the accelerator)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        # legacy=True (the default): the tuple, never the dict numpy's stub also allows
        legacy = cast("tuple[str, Any, int, int, float]", np.random.get_state())
        name, keys, pos, has_gauss, gauss = legacy
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


def prune(directory: Path, keep_last: int, newest: Path) -> None:
    """Keep the ``keep_last`` newest checkpoints (never ``newest``)."""
    for old in list_checkpoints(directory)[:-keep_last]:
        if old != newest:
            remove_checkpoint(old)
