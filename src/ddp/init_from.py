"""``model.init_from``: starting weights for any recipe, separate from resume.

Resume (``checkpoint.resume``) continues a run: weights, optimizer, schedule, RNG and
data position. ``init_from`` only sets where the *weights* start, so a run can begin
from a pretrained model or from another run's result with a fresh optimizer and its
own schedule (a DPO run from an SFT model, a fine-tune from a pretraining export).
When a run resumes, its checkpoint's weights replace these, so resume keeps its meaning.

A source is one of:

* a Hugging Face model folder (it holds ``config.json``) or a hub id: its weights
  (``*.safetensors``, else ``pytorch_model.bin`` read with ``weights_only``);
* a ``final/model.pt`` export of this project (a plain state dict);
* a step checkpoint (``step_N.pt``) or a checkpoint directory (its newest valid
  checkpoint): only its ``model`` entry, read with :mod:`ddp.checkpoint`'s checked
  reader (digest, fields), never its optimizer or position.

Nothing here executes code from the source: tensors are read with safetensors or
``torch.load(weights_only=True)``; no ``trust_remote_code`` is involved at all (a
recipe that builds a whole model from a folder, as dpo does, passes the user's
``model.trust_remote_code``, off by default). A source whose keys or shapes differ
from the model is one :class:`ConfigError` line naming the first mismatched key.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp.errors import ConfigError

if TYPE_CHECKING:
    import torch

KEY = "model.init_from"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?\Z")
_INDEX_LIMIT = 64 << 20  # a safetensors index / config.json is a few hundred kB at most


def is_hf_source(source: str) -> bool:
    """A Hugging Face model folder (with ``config.json``), or a name that can only be a
    hub id (no such path here). Recipes that build their model from a folder (dpo)
    use this to hand such a source to ``from_pretrained`` instead."""
    p = Path(source)
    if p.exists():
        return p.is_dir() and (p / "config.json").is_file()
    return bool(_HUB_ID.match(source)) and not source.endswith(".pt")


def hub_folder(source: str, patterns: list[str] | None = None) -> Path:
    """The local folder of a hub id (downloaded once into the Hugging Face cache;
    ``HF_HUB_OFFLINE=1`` reads the cache only), or the folder itself."""
    p = Path(source)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            f"{KEY}: {source!r} is no local path, and reading a hub id needs "
            "huggingface_hub: pip install 'hpc-ddp[dpo]'"
        ) from None
    allow = patterns or ["config.json", "*.safetensors", "*.safetensors.index.json"]
    try:
        return Path(snapshot_download(source, allow_patterns=allow))
    except Exception as exc:  # offline, unknown repo, gated, network: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(
            f"{KEY}: {source!r} is no local path and the hub gave no model "
            f"({first}); allowed: a model folder, a .pt file or a hub id"
        ) from None


def read_state(source: str) -> dict[str, torch.Tensor]:
    """The weights that ``source`` holds, as a CPU state dict (see the module doc)."""
    if not source:
        raise ConfigError(f"{KEY}: empty; allowed: a model folder, a .pt file or a hub id")
    p = Path(source)
    if is_hf_source(source):
        return _read_hf(hub_folder(source))
    if p.is_dir():
        return _read_checkpoint_dir(p)
    if not p.exists():
        raise ConfigError(
            f"{KEY}: {source!r} does not exist; allowed: a model folder, "
            "a final/model.pt export, a step checkpoint or a hub id"
        )
    return _read_pt(p)


def _read_bytes(path: Path, limit: int | None = None) -> bytes:
    from hpc_ddp import files as _files

    try:
        return _files.read_regular(path, limit)[0]
    except ValueError as exc:
        raise ConfigError(f"{KEY}: {str(path)!r} {exc}") from None


def _tensor_map(obj: Any, path: Path, what: str) -> dict[str, torch.Tensor]:
    import torch

    if (
        not isinstance(obj, dict)
        or not obj
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    ):
        raise ConfigError(f"{KEY}: {str(path)!r} {what}; allowed: a mapping of names to tensors")
    return obj


def _read_pt(path: Path) -> dict[str, torch.Tensor]:
    """An export (plain state dict) or a step checkpoint (its ``model`` only)."""
    import torch

    data = _read_bytes(path)
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # damaged or crafted: whatever the unpickler raised, one line
        raise ConfigError(
            f"{KEY}: {str(path)!r} is not a loadable weights file "
            f"({type(exc).__name__}); allowed: a final/model.pt export, a "
            "step_N.pt checkpoint or a Hugging Face model folder"
        ) from None
    if isinstance(obj, dict) and "global_step" in obj and "format" in obj:
        return _checkpoint_model(path)  # re-read through the checked reader (digest, fields)
    return _tensor_map(obj, path, "holds no state dict")


def _checkpoint_model(path: Path, state: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    from ddp import checkpoint as ckpt

    if state is None:
        try:
            state = ckpt.read_checkpoint(path, ranks=False)
        except ValueError as exc:
            raise ConfigError(f"{KEY}: checkpoint {str(path)!r} {exc}") from None
    if "sharded" in state:
        raise ConfigError(
            f"{KEY}: {str(path)!r} is a sharded (FSDP) checkpoint; allowed: a "
            "step_N.pt checkpoint or the run's final/model.pt export"
        )
    return _tensor_map(state.get("model"), path, "has no model state")


def _read_checkpoint_dir(directory: Path) -> dict[str, torch.Tensor]:
    """A checkpoint directory: its newest valid checkpoint (as resume would pick it)."""
    from ddp import checkpoint as ckpt

    if ckpt.list_checkpoints(directory):
        found = ckpt.load_latest(directory, ranks=False)
        if found is not None:
            return _checkpoint_model(found[0], found[1])
    raise ConfigError(
        f"{KEY}: {str(directory)!r} holds no config.json and no readable "
        "checkpoint; allowed: a Hugging Face model folder, a checkpoint "
        "directory, a .pt file or a hub id"
    )


def _read_hf(folder: Path) -> dict[str, torch.Tensor]:
    """Weights of a Hugging Face model folder: safetensors (one file or an index of
    shards), else ``pytorch_model.bin`` read with ``weights_only``."""

    index = folder / "model.safetensors.index.json"
    files: list[Path] = []
    if index.is_file():
        try:
            names = json.loads(_read_bytes(index, _INDEX_LIMIT))["weight_map"].values()
        except (ValueError, KeyError, AttributeError, TypeError):
            raise ConfigError(f"{KEY}: {str(index)!r} is no safetensors index") from None
        for name in dict.fromkeys(names):
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise ConfigError(
                    f"{KEY}: {str(index)!r} names {name!r}; allowed: a file in the same folder"
                )
            files.append(folder / name)
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    if files:
        from safetensors.torch import load as st_load

        state: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                state.update(st_load(_read_bytes(f)))
            except Exception as exc:  # a damaged or crafted header
                raise ConfigError(
                    f"{KEY}: {str(f)!r} is no readable safetensors file ({type(exc).__name__})"
                ) from None
        return _tensor_map(state, folder, "holds no weights")
    if (folder / "pytorch_model.bin").is_file():
        return _read_pt(folder / "pytorch_model.bin")
    raise ConfigError(
        f"{KEY}: {str(folder)!r} has no model.safetensors, safetensors index or pytorch_model.bin"
    )


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``model.load_state_dict(state)`` after a check that names the first mismatch.

    A key the source lacks is accepted only when the model ties it to a key the source
    has (GPT-2's ``lm_head.weight`` is ``wte.weight``; ``save_pretrained`` writes one).
    A prefix ``module.`` (a DDP-wrapped save elsewhere) is removed.
    """
    import torch

    if all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    own = model.state_dict(keep_vars=True)
    by_storage: dict[int, list[str]] = {}
    for k, v in own.items():
        by_storage.setdefault(v.data_ptr(), []).append(k)
    for k, v in own.items():
        if k not in state:
            if any(t in state for t in by_storage[v.data_ptr()] if t != k) and v.numel():
                continue
            raise ConfigError(
                f"{KEY}: {source!r} does not fit this model: it has no {k!r}; "
                "allowed: weights of the same architecture (the model.* "
                "settings of the run that saved them)"
            )
        if tuple(state[k].shape) != tuple(v.shape):
            raise ConfigError(
                f"{KEY}: {source!r} does not fit this model: {k!r} is "
                f"{tuple(state[k].shape)} there and {tuple(v.shape)} here; "
                "allowed: weights of the same architecture"
            )
    extra = [k for k in state if k not in own]
    if extra:
        raise ConfigError(
            f"{KEY}: {source!r} does not fit this model: it has {extra[0]!r}, "
            "which this model lacks; allowed: weights of the same architecture"
        )
    with torch.no_grad():
        for k, v in own.items():
            if k in state:
                v.copy_(state[k])


def apply(model: torch.nn.Module, source: str) -> None:
    """Load ``source``'s weights into ``model`` (the generic path for every recipe)."""
    import logging

    load_into(model, read_state(source), source)
    logging.getLogger("ddp").info("%s: weights loaded from %s", KEY, source)
