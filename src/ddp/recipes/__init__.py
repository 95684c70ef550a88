"""Recipe registry: the seed workloads, small but real, runnable with ``python -m ddp NAME``.

A recipe module exposes:

* ``DESCRIPTION``: one line for ``python -m ddp --list``;
* ``DEFAULTS``: a TrainConfig mapping; its ``model:`` and ``recipe:`` sections
  also define which recipe-specific keys exist and their types;
* ``FLAGS``: the recipe's own command-line flags (as in the seed guides), each
  mapped onto a dotted config key;
* ``build(config) -> Built``: model, datasets, step and eval functions.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ddp.config import TrainConfig, check_free_section, read_yaml
from ddp.errors import ConfigError

RECIPES: dict[str, str] = {
    "uniref50": "ddp.recipes.uniref50",
    "dpo": "ddp.recipes.dpo",
    "distill": "ddp.recipes.distill",
    "crowdbt": "ddp.recipes.crowdbt",
    "gnn": "ddp.recipes.gnn",
}
DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Flag:
    """A recipe flag such as ``--learning_rate`` that sets the dotted key ``optim.lr``."""

    name: str
    key: str
    type: Callable[[str], Any]
    help: str


@dataclass
class Built:
    model: Any
    train_data: Any
    eval_data: Any
    step_fn: Callable[..., Any] | None
    eval_fn: Callable[..., Any] | None = None
    collate_fn: Callable[..., Any] | None = None
    #: ``after_fit(trainer, summary)`` runs on every rank once training ended normally
    #: (not after a failure or preemption), e.g. to export inference artifacts.
    after_fit: Callable[[Any, dict[str, Any]], None] | None = None


def names() -> list[str]:
    return sorted(RECIPES)


def get(name: str) -> ModuleType:
    """The recipe module for ``name``; a ConfigError with the nearest name otherwise."""
    if name not in RECIPES:
        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown recipe {name!r}{hint} (known: {', '.join(names())})")
    return importlib.import_module(RECIPES[name])


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_flags(parser: argparse.ArgumentParser, recipe: ModuleType) -> None:
    for flag in recipe.FLAGS:
        if flag.type is bool:
            # As in the seed guides: a bare `--skip_phase1` means true; `--flag false` works too.
            parser.add_argument(flag.name, type=_bool, nargs="?", const=True, default=None,
                                dest=_dest(flag), help=flag.help)
        else:
            parser.add_argument(flag.name, type=flag.type, default=None, dest=_dest(flag),
                                help=flag.help)


def _dest(flag: Flag) -> str:
    return "flag_" + flag.name.lstrip("-").replace("-", "_")


def resolve(
    recipe: ModuleType,
    config_file: str | Path | None = None,
    sets: Sequence[str] = (),
    flags: argparse.Namespace | dict[str, Any] | None = None,
) -> TrainConfig:
    """Recipe defaults <- YAML file <- recipe flags <- ``--set`` (later wins), validated."""
    data = copy.deepcopy(recipe.DEFAULTS)
    if config_file is not None:
        raw = read_yaml(config_file)
        TrainConfig.from_dict(raw)  # validate the file on its own, so errors name its keys
        _merge(data, raw)
    cfg = TrainConfig.from_dict(data)
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    values = {}
    for flag in recipe.FLAGS:
        value = given.get(_dest(flag), given.get(flag.name.lstrip("-")))
        if value is not None:
            values[flag.key] = value
    cfg = cfg.with_values(values).override(list(sets))
    check_free_section(cfg, "model", recipe.DEFAULTS.get("model", {}))
    check_free_section(cfg, "recipe", recipe.DEFAULTS.get("recipe", {}))
    check_model_values(cfg.model)
    return cfg


def check_model_values(model: dict[str, Any]) -> None:
    """Sizes are never negative, dropouts are probabilities, heads divide the width.

    Caught here with one line instead of deep inside ``nn.Module`` construction."""
    for key, value in model.items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"model.{key}: {value}; allowed: a size >= 0")
        if "dropout" in key and isinstance(value, int | float) and not 0 <= value < 1:
            raise ConfigError(f"model.{key}: {value}; allowed: a probability in [0, 1)")
    d, h = model.get("d_model"), model.get("n_heads")
    if isinstance(d, int) and isinstance(h, int):
        if d < 1 or h < 1 or d % h:
            raise ConfigError(f"model.n_heads: {h} does not divide model.d_model: {d}; "
                              "allowed: d_model a positive multiple of n_heads")  # fmt: skip


def _merge(base: dict[str, Any], raw: dict[str, Any]) -> None:
    """Overlay only the keys the YAML file really sets (validated already)."""

    def deep(dst: dict[str, Any], src: dict[str, Any]) -> None:
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict) and k not in ("phases",):
                deep(dst[k], v)
            else:
                dst[k] = v

    deep(base, raw)
