"""Sharded checkpoints for FSDP models, through ``torch.distributed.checkpoint`` (DCP).

Layout (one directory per checkpoint, beside the ``step_N.pt`` files of DDP runs)::

    step_000000120/
        __0_0.distcp __1_0.distcp ...   every rank's shards of model and optimizer state
        .metadata                       DCP's index of the shards
        rank_000000.pt rank_000001.pt   each rank's own: its RNG states, its shards' digests
        meta.pt  meta.pt.sha256         rank 0: everything else, and .metadata's digest

Every rank writes its own shards and rank file into the staging directory ``.step_N.tmp``
(collectively; by default in the background, :func:`save_async`), then, once every
rank's write has finished, rank 0 adds the meta file and renames the directory into
place; ``latest`` moves after that, so a ``kill -9`` at any moment leaves ``latest`` on a
complete checkpoint (a ``.tmp`` directory is never a checkpoint to the resume lookup and
is removed by a later save). DCP reshards on load, so a run resumes on any number of
ranks.

Checkpoints are untrusted input. DCP itself unpickles its ``.metadata`` file and
``torch.load``\\ s non-tensor values with ``weights_only=False``; here only tensors go
through DCP (non-tensor optimizer values travel in ``meta.pt``, which loads with
``weights_only=True``), the metadata is read with an unpickler that builds DCP's own
metadata classes and nothing else, and the load planner refuses pickled values.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

# ---- only tensors through DCP --------------------------------------------------------------


def split(tree: Any) -> tuple[Any, Any]:
    """(tensor leaves, other leaves) of a nested dict, each keeping the dict structure."""
    if isinstance(tree, dict):
        tensors, others = {}, {}
        for k, v in tree.items():
            t, o = split(v)
            if t is not None:
                tensors[k] = t
            if o is not None:
                others[k] = o
        return tensors or None, others or None
    if isinstance(tree, torch.Tensor):
        return tree, None
    return None, tree


def merge(tensors: Any, others: Any) -> Any:
    """Inverse of :func:`split`."""
    if tensors is None:
        return others
    if others is None:
        return tensors
    out = dict(tensors)
    for k, v in others.items():
        out[k] = merge(out.get(k), v)
    return out


# ---- safe reading of DCP's metadata ----------------------------------------------------------

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch dtypes and sizes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} in DCP metadata")


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            with open(Path(self.path) / ".metadata", "rb") as fh:
                metadata = _MetadataUnpickler(io.BytesIO(fh.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise pickle.UnpicklingError(
                f"checkpoint holds a pickled value at {read_item.dest_index.fqn}; refused"
            )

    return TensorsOnly()


# ---- save and load ---------------------------------------------------------------------------


def state(model: nn.Module, opt: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """Model and optimizer state dicts keyed by parameter names (sharded tensors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if opt is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, opt)


def _parts(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict[str, Any]]:
    """(the tensors DCP writes, what goes into the meta file: the optimizer's non-tensor
    values and param groups, copied so that later steps cannot change them)."""
    msd, osd = state(model, opt)
    assert osd is not None
    opt_tensors, opt_other = split(osd.get("state", {}))
    extra = {"optim_other": opt_other, "param_groups": osd.get("param_groups")}
    return {"model": msd, "optim": opt_tensors or {}}, copy.deepcopy(extra)


def save(
    directory: Path, model: nn.Module, opt: torch.optim.Optimizer, group: Any = None
) -> dict[str, Any]:
    """Collective: every rank writes its shards into ``directory``; returns what must go
    into the meta file (the optimizer's non-tensor values and param groups)."""
    import torch.distributed.checkpoint as dcp

    tensors, extra = _parts(model, opt)
    dcp.save(tensors, checkpoint_id=str(directory), process_group=group)
    return extra


def save_async(
    directory: Path, model: nn.Module, opt: torch.optim.Optimizer, group: Any = None
) -> tuple[dict[str, Any], Callable[[], None]]:
    """Collective: copy this rank's shards to CPU memory now, write them into
    ``directory`` in a background thread (DCP's ``async_save``); returns (what goes into
    the meta file, a function that waits for the write of every rank and raises its
    failure: DCP gathers every rank's error and raises the same one on all).

    ``group``: a Gloo group that nothing else uses while the write runs (its collectives
    run in DCP's thread; ``ddp.dist.checkpoint_group``). Only the copy blocks the caller:
    training may change the weights as soon as this returns.
    """
    import torch.distributed.checkpoint as dcp

    tensors, extra = _parts(model, opt)
    future: Any = dcp.async_save(tensors, checkpoint_id=str(directory), process_group=group)
    future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse: its write

    def written() -> None:
        future.result()

    return extra, written


def saved_shapes(directory: Path, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's whole (unsharded) shape in a checkpoint, by name under ``prefix``
    (``model``), from DCP's metadata read with the safe unpickler."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ddp.errors import ConfigError

    try:
        metadata = _reader(directory).read_metadata()
        head = prefix + "."
        return {
            fqn[len(head) :]: tuple(int(n) for n in meta.size)
            for fqn, meta in metadata.state_dict_metadata.items()
            if fqn.startswith(head) and isinstance(meta, TensorStorageMetadata)
        }
    except Exception as exc:  # crafted or damaged (its digest was checked: crafted)
        raise ConfigError(
            f"checkpoint {str(directory)!r} has unreadable shard metadata "
            f"(.metadata: {first_line(exc)})"
        ) from None


def first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _load(box: dict[str, Any], directory: Path, path: str) -> None:
    """Collective: DCP's load into ``box``; a failure is one ConfigError line on every
    rank (DCP raises the same CheckpointException on all): a pickled value the planner
    refuses, or shards that do not hold what the metadata says."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ddp.errors import ConfigError

    try:
        dcp.load(box, storage_reader=_reader(directory), planner=_planner())
    except (Exception, CheckpointException) as exc:
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            first = failures[min(failures)]
            exc = first[0] if isinstance(first, tuple) else first
        raise ConfigError(f"checkpoint {path!r} cannot be loaded ({first_line(exc)})") from None


def load_model(directory: Path, model: nn.Module, path: str | None = None) -> None:
    """Collective: the model's shards from ``directory``, resharded to this world size.

    A checkpoint of another model (a name or a whole shape differs) is one ConfigError
    line naming the first mismatch and both shapes, as for a plain checkpoint
    (:func:`ddp.checkpoint.check_same_model`); every rank reads the same metadata, so
    every rank stops with the same line before any collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from ddp.checkpoint import check_same_model

    msd, _ = state(model, None)
    check_same_model(
        saved_shapes(directory, "model"),
        {k: tuple(v.shape) for k, v in msd.items()},
        path or directory,
    )
    box = {"model": msd}
    _load(box, directory, path or str(directory))
    set_model_state_dict(model, box["model"])


def load_optimizer(
    directory: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    meta: dict[str, Any],
    path: str | None = None,
) -> None:
    """Collective: the optimizer's shards, with its non-tensor values from ``meta``.

    Their names and whole shapes are checked against this optimizer's first, and the
    meta file's param groups against its groups: one ConfigError line on every rank."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    _, osd = state(model, opt)
    assert osd is not None
    tensors, _ = split(osd.get("state", {}))
    box = {"optim": tensors or {}}
    _check_optimizer(directory, box["optim"], osd, meta, path or str(directory))
    _load(box, directory, path or str(directory))
    full: dict[str, Any] = {
        "state": merge(box["optim"], meta.get("optim_other")) or {},
        "param_groups": meta.get("param_groups") or osd.get("param_groups"),
    }
    set_optimizer_state_dict(model, opt, full)


def _flat_shapes(tree: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """DCP's flat names (``a.b.c``) of a nested dict's tensors, with their whole shapes."""
    out: dict[str, tuple[int, ...]] = {}
    for k, v in (tree or {}).items():
        if isinstance(v, dict):
            out.update(_flat_shapes(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = tuple(v.shape)
    return out


def _check_optimizer(
    directory: Path, tensors: Any, osd: dict[str, Any], meta: dict[str, Any], path: str
) -> None:
    """ConfigError (one line) if the checkpoint's optimizer cannot be this one's."""
    from ddp.checkpoint import check_like
    from ddp.errors import ConfigError

    saved = saved_shapes(directory, "optim")
    try:
        for name, shape in _flat_shapes(tensors).items():
            if name not in saved:
                raise ValueError(f"misses the optimizer state {name!r}")
            if saved[name] != shape:
                raise ValueError(
                    f"has the optimizer state {name!r} of shape {saved[name]}; "
                    f"allowed: {shape}, as this optimizer has"
                )
        groups, live = meta.get("param_groups"), osd.get("param_groups")
        if groups is not None and live is not None:
            check_like(groups, live, "param_groups")
        _check_plain(meta.get("optim_other"), "optim_other")
    except ValueError as exc:
        raise ConfigError(f"checkpoint {path!r} {exc}") from None


def _check_plain(tree: Any, name: str) -> None:
    """ValueError unless every leaf of ``tree`` (the optimizer's non-tensor values) is
    null, a boolean or a finite number: what optimizers keep besides tensors."""
    import math

    if isinstance(tree, dict):
        for k, v in tree.items():
            _check_plain(v, f"{name}.{k}")
    elif tree is not None and not (
        type(tree) in (bool, int) or (type(tree) is float and math.isfinite(tree))
    ):
        raise ValueError(
            f"has a bad {name}: {tree!r:.60}; allowed: null, a boolean or a finite number"
        )
