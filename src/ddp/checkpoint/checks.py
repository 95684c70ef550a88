"""What a loaded checkpoint may hold: field-by-field checks of untrusted state.

A checkpoint passes ``torch.load(weights_only=True)`` and its digest, and may still be
crafted or from another run: every field the trainer restores is checked here for its
type, range and shape before anything is applied, so a wrong one is one line naming
the field (``ValueError``), never a traceback deep inside torch.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp.checkpoint.layout import _SHARD_RE, FORMAT_VERSION

log = logging.getLogger("ddp")

# ---- what a loaded checkpoint may hold ---------------------------------------------------
_I64 = 1 << 63


def _count(low: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v < _I64


def _is_tensor_map(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in v.items()
    )


def _is_optimizer(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and isinstance(v.get("state"), dict)
        and isinstance(v.get("param_groups"), list)
        and all(isinstance(g, dict) for g in v["param_groups"])
    )


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
        isinstance(k, str)
        and _SHARD_RE.match(k)
        and isinstance(d, str)
        and re.fullmatch(r"[0-9a-f]{64}", d)
        for k, d in v.items()
    )


#: Every field a checkpoint may hold: (its check, what is allowed). Checked wherever one
#: is loaded (:func:`check_fields`), so no crafted value reaches the trainer.
FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format": (
        lambda v: type(v) is int and 1 <= v <= FORMAT_VERSION,
        f"an integer from 1 to {FORMAT_VERSION} (a newer one needs a newer ddp)",
    ),
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
    "rank_rng": (lambda v: v is None or isinstance(v, dict), "a mapping of one rank's RNG states"),
    "rank_shards": (_is_shard_list, "a mapping of shard file names to sha256 digests"),
    "config": (
        lambda v: isinstance(v, dict) and _is_plain_tree(v),
        "a mapping of plain values (the run's config)",
    ),
    "scheduler": (lambda v: isinstance(v, dict), "a mapping (a scheduler's state)"),
    "scaler": (lambda v: v is None or isinstance(v, dict), "a mapping or null"),
    "model": (_is_tensor_map, "a mapping of parameter names to tensors"),
    "optimizer": (_is_optimizer, "an optimizer's state (state and param_groups)"),
    "shards": (_is_shard_list, "a mapping of shard file names to sha256 digests"),
    "optim_other": (lambda v: v is None or isinstance(v, dict), "a mapping or null"),
    "param_groups": (
        lambda v: v is None or (isinstance(v, list) and all(isinstance(g, dict) for g in v)),
        "a list of mappings or null",
    ),
}

#: What a checkpoint must hold for the trainer to resume from it.
TRAINER_FIELDS = ("global_step", "phase", "epoch", "scheduler")


def _show(value: Any) -> str:
    text = (
        repr(value)
        if not isinstance(value, torch.Tensor)
        else (f"a {value.dtype} tensor of shape {tuple(value.shape)}")
    )
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
        raise ValueError(
            f"has a bad phase_start_step: {obj['phase_start_step']} is after "
            f"its global_step {obj['global_step']}"
        )
    if obj.get("rank", -1) >= obj.get("world_size", _I64):
        raise ValueError(
            f"has a bad rank: {obj['rank']} is not below its world_size {obj['world_size']}"
        )
    for i, state in enumerate(obj.get("rng") or []):  # written before rank files
        check_rng_state(state, f"rng[{i}]")
    if obj.get("rank_rng") is not None:
        check_rng_state(obj["rank_rng"], "rank_rng")


def check_rng_state(state: Any, name: str = "rng") -> None:
    """ValueError unless ``state`` is one rank's RNG states as :func:`rng_state` makes
    them: each is tried on a throwaway generator, never on this process's own."""
    if not isinstance(state, dict) or "python" not in state or "torch" not in state:
        raise ValueError(
            f"has a bad {name}: {_show(state)}; allowed: a mapping with the "
            "python and torch RNG states"
        )

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
            (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss)
        )

    def device(v: Any) -> None:
        if not (isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1):
            raise ValueError(v)

    checks = {"python": python, "torch": torch_cpu, "numpy": numpy, "cuda": device, "xpu": device}
    for key, value in state.items():
        check = checks.get(key)
        try:
            if check is None:
                raise ValueError(key)
            check(value)
        except Exception:  # what each generator says of a state it cannot take
            raise ValueError(
                f"has a bad {name}.{key}: {_show(value)}; allowed: the state "
                f"that ddp saves for this generator"
            ) from None


def check_same_model(
    saved: dict[str, tuple[int, ...]], own: dict[str, tuple[int, ...]], path: str | Path
) -> None:
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
        if (
            type(saved) not in (int, float)
            or not math.isfinite(saved)
            or (type(live) is int and type(saved) is not int)
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
