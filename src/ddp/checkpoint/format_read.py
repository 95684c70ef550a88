"""Reading checkpoints: the resume lookup and every check a loaded checkpoint passes.

A checkpoint is untrusted input: a regular file, bounded in size, its digest matching,
loaded with ``weights_only``, every field checked (:mod:`ddp.checkpoint.checks`); each
rank file likewise. A damaged checkpoint is skipped with a warning by the lookup
(:func:`readable_checkpoints`) and is one ConfigError line when the user named it
(:func:`load_checkpoint`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ddp.checkpoint.checks import _show, check_fields
from ddp.checkpoint.files import _digest_path, read_regular, sha256_file
from ddp.checkpoint.format import _is_checkpoint, list_checkpoints, rank_dir, rank_file_name
from ddp.checkpoint.layout import _RANK_HEADER, _STEP_RE, LATEST, META, RANK_FILE_LIMIT

log = logging.getLogger("ddp")


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
        raise ValueError(
            f"has a rank directory {path.parent.name} that is a symbolic link; allowed: a directory"
        )
    try:
        data = read_regular(path, RANK_FILE_LIMIT)
    except ValueError as exc:
        if not os.path.lexists(path):
            raise ValueError(f"misses its rank file {where}") from None
        raise ValueError(f"has a rank file {where} that {exc}") from None
    head, newline, payload = data.partition(b"\n")
    if not newline or not head.startswith(_RANK_HEADER):
        raise ValueError(f"has a rank file {where} that is not one ddp writes (no digest line)")
    if hashlib.sha256(payload).hexdigest().encode() != head[len(_RANK_HEADER) :]:
        raise ValueError(f"has a damaged rank file {where} (digest mismatch)")
    try:
        obj = _load_bytes(payload)
        check_fields(obj, required=RANK_FIELDS)
        for key, want in (
            ("global_step", saved.get("global_step")),
            ("world_size", saved.get("world_size")),
            ("rank", rank),
        ):
            if obj[key] != want:
                raise ValueError(
                    f"has a bad {key}: {_show(obj[key])}; allowed: {want!r}, the checkpoint's"
                )
        for name in obj.get("rank_shards") or {}:
            if not re.fullmatch(rf"__{rank}_\d+\.distcp", name):
                raise ValueError(
                    f"has a bad rank_shards: {name!r}; allowed: this rank's "
                    f"shards (__{rank}_N.distcp)"
                )
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
