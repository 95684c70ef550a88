"""Recipe registry: the seed workloads, small but real, runnable with ``python -m ddp NAME``.

A recipe is a module that satisfies :class:`Recipe` (checked when it is loaded):

* ``NAME``: its name in :data:`RECIPES`;
* ``DESCRIPTION``: one line for ``python -m ddp --list``;
* ``DEFAULTS``: a TrainConfig mapping; its ``model:`` and ``recipe:`` sections
  also define which recipe-specific keys exist and their types;
* ``FLAGS``: the recipe's own command-line flags (as in the seed guides), each
  mapped onto a dotted config key. The flags every recipe shares (backend, output
  directory, seed, max steps) are :data:`COMMON_FLAGS`, defined once here;
* ``build(config) -> Built``: model, datasets, step and eval functions. A recipe
  builds its model with :func:`seeded_model`, so every rank starts from the same
  weights.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from ddp.config import TrainConfig, check_free_section, check_sweep_paths, read_yaml
from ddp.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

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
    """A recipe flag such as ``--learning_rate`` that sets the dotted key ``optim.lr``.

    ``aliases`` are other spellings of the same flag (the seed guides write some
    flags with ``_`` and others with ``-``); they share one destination.
    """

    name: str
    key: str
    type: Callable[[str], Any]
    help: str
    aliases: tuple[str, ...] = ()
    #: Not None: the value may be left out, and a bare flag means ``const``
    #: (crowdbt's ``--pretrained`` = the library's cached weights, ``--pretrained PATH``).
    const: Any = None

    @property
    def dest(self) -> str:
        """The argparse destination: ``--output-dir`` and ``--output_dir`` both give flag_output_dir."""
        return "flag_" + self.name.lstrip("-").replace("-", "_")


#: Flags every recipe takes, defined once. A recipe's own FLAGS must not reuse these
#: names (argparse refuses the clash when the recipe's parser is built); a recipe may
#: add its seed's own spelling for the same key, as uniref50's ``--work_dir`` does.
COMMON_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--backend", "ddp.backend", str, "process-group backend: auto, nccl, gloo, xccl, ccl, mpi"
    ),
    Flag(
        "--output_dir",
        "checkpoint.dir",
        str,
        "checkpoints and the final model go here",
        aliases=("--output-dir",),
    ),
    Flag("--seed", "training.seed", int, "seed of the initial weights, data order and noise"),
    Flag(
        "--max_steps",
        "training.max_steps",
        int,
        "stop after this many optimizer steps",
        aliases=("--max-steps",),
    ),
    # ddp.init_from: starting weights (HF folder or hub id, final/model.pt, step checkpoint)
    Flag(
        "--init_from",
        "model.init_from",
        str,
        "starting weights: a Hugging Face model folder "
        "or hub id, a final/model.pt export or a step checkpoint (resume is separate)",
    ),
)

#: Model keys every recipe has (``ddp.init_from``); "" = the recipe's own initial weights.
COMMON_MODEL_KEYS: dict[str, Any] = {"init_from": ""}

StepFn = Callable[["torch.nn.Module", Any], Any]


@dataclass
class Built:
    """What ``build(config)`` hands to the Trainer."""

    model: torch.nn.Module
    train_data: Dataset[Any]
    eval_data: Dataset[Any] | None = None
    #: ``step_fn(model, batch) -> {"loss": ..., other metrics}``; None: ``model(batch)``.
    step_fn: StepFn | None = None
    eval_fn: StepFn | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    #: ``after_fit(trainer, summary)`` runs on every rank once training ended normally
    #: (not after a failure or preemption), e.g. to export inference artifacts.
    after_fit: Callable[[Any, dict[str, Any]], None] | None = None
    #: ``after_step(trainer, step)`` runs on every rank after each optimizer step (uniref50
    #: writes samples at monitoring.sample_frequency); ``finish_eval(metrics) -> metrics``
    #: derives numbers from the aggregated evaluation (its perplexity bound).
    after_step: Callable[[Any, int], None] | None = None
    finish_eval: Callable[[dict[str, float]], dict[str, float]] | None = None
    #: True when build() already loaded ``model.init_from`` itself (dpo: before it copies
    #: the policy into the reference); otherwise ``python -m ddp`` loads it generically.
    init_done: bool = False
    #: ``on_epoch_end(epoch, epochs, train_loss, eval_metrics)`` on every rank after each
    #: epoch (eval_metrics {} when that epoch did not evaluate): a seed's epoch summary.
    on_epoch_end: Callable[[int, int, float, dict[str, float]], None] | None = None


@runtime_checkable
class Recipe(Protocol):
    """What a recipe module provides; ``python -m ddp`` relies on nothing else."""

    NAME: str
    DESCRIPTION: str
    DEFAULTS: dict[str, Any]
    FLAGS: list[Flag]

    def build(self, config: TrainConfig) -> Built: ...


M = TypeVar("M", bound="torch.nn.Module")


def seeded_model(seed: int, make: Callable[[], M]) -> M:
    """``make()`` with the CPU generator seeded by ``seed``: the same initial weights on
    every rank, in every run with this seed, whatever the world size.

    Why not rely on DDP, which broadcasts rank 0's weights when it wraps the model:
    the weights would then still depend on what drew random numbers before the
    build (data generation differs between recipes and code paths), so a 1-rank and
    an 8-rank run, or a rerun, would not start from the same point, and a module kept
    outside the wrapped model (distill's frozen teacher) is never broadcast at all.
    The caller's RNG state is restored afterwards, so the Trainer's per-rank streams
    (dropout, masks) are untouched. Only the CPU generator is used: models are built
    on the CPU, and forking every GPU's generator would initialise CUDA in a process
    that has not yet picked its device.
    """
    import torch

    state = torch.random.get_rng_state()
    torch.random.default_generator.manual_seed(seed)
    try:
        return make()
    finally:
        torch.random.set_rng_state(state)


def names() -> list[str]:
    return sorted(RECIPES)


def get(name: str) -> Recipe:
    """The recipe module for ``name``; a ConfigError with the nearest name otherwise."""
    if name not in RECIPES:
        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown recipe {name!r}{hint} (known: {', '.join(names())})")
    module = importlib.import_module(RECIPES[name])
    if not isinstance(module, Recipe):  # a programming error in the recipe, not the user's
        missing = [
            a
            for a in ("NAME", "DESCRIPTION", "DEFAULTS", "FLAGS", "build")
            if not hasattr(module, a)
        ]
        raise TypeError(f"{RECIPES[name]} is not a recipe: missing {', '.join(missing)}")
    return module


def all_flags(recipe: Recipe) -> list[Flag]:
    """The recipe's own flags, then the common ones."""
    return [*recipe.FLAGS, *COMMON_FLAGS]


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_flags(
    parser: argparse.ArgumentParser, recipe: Recipe, shown: TrainConfig | None = None
) -> None:
    """Add the recipe's flags and the common ones, in two help groups.

    Each flag's help names the config key it sets and, when ``shown`` is given, the
    value that key has without the flag (recipe defaults <- ``--config`` <- ``--set``).
    """
    own = parser.add_argument_group(
        f"{recipe.NAME} flags", "each sets the config key in brackets (--set KEY=VALUE wins)"
    )
    common = parser.add_argument_group("flags of every recipe")
    for group, flags in ((own, recipe.FLAGS), (common, COMMON_FLAGS)):
        for flag in flags:
            _add_flag(group, flag, shown)


def _add_flag(group: argparse._ActionsContainer, flag: Flag, shown: TrainConfig | None) -> None:
    about = f"{flag.help} [{flag.key}"
    if shown is not None:
        about += f"; default: {_value_at(shown, flag.key)!r}"
    about = (about + "]").replace("%", "%%")  # argparse %-formats help strings
    metavar = flag.dest[len("flag_") :].upper()
    if flag.type is bool:
        # As in the seed guides: a bare `--skip_phase1` means true; `--flag false` works too.
        group.add_argument(
            flag.name,
            *flag.aliases,
            type=_bool,
            nargs="?",
            const=True,
            default=None,
            dest=flag.dest,
            metavar=metavar,
            help=about,
        )
    elif flag.const is not None:
        group.add_argument(
            flag.name,
            *flag.aliases,
            type=flag.type,
            nargs="?",
            const=flag.const,
            default=None,
            dest=flag.dest,
            metavar=metavar,
            help=about,
        )
    else:
        group.add_argument(
            flag.name,
            *flag.aliases,
            type=flag.type,
            default=None,
            dest=flag.dest,
            metavar=metavar,
            help=about,
        )


def _value_at(config: TrainConfig, key: str) -> Any:
    """The value at a dotted key (``phases.0.lr`` indexes the list); None when absent."""
    node: Any = config.to_dict()
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def resolve(
    recipe: Recipe,
    config_file: str | Path | None = None,
    sets: Sequence[str] = (),
    flags: argparse.Namespace | dict[str, Any] | None = None,
) -> TrainConfig:
    """Recipe defaults <- YAML file <- recipe flags <- ``--set`` (later wins), validated.

    The YAML file is read and parsed once and validated once, merged over the defaults
    (every key keeps its dotted name in errors, so they still point at the file's keys).
    """
    data = copy.deepcopy(recipe.DEFAULTS)
    if config_file is not None:  # its aliases and final-LR rule: ddp.config.read_yaml
        _merge(data, read_yaml(config_file))
    cfg = TrainConfig.from_dict(data)
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    values = {}
    for flag in all_flags(recipe):
        spellings = [flag.dest] + [n.lstrip("-") for n in (flag.name, *flag.aliases)]
        value = next((given[k] for k in spellings if given.get(k) is not None), None)
        if value is not None:
            values[flag.key] = value
    cfg = cfg.with_values(values).override(list(sets))
    check_sweep_paths(cfg)
    check_free_section(cfg, "model", {**COMMON_MODEL_KEYS, **recipe.DEFAULTS.get("model", {})})
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
            raise ConfigError(
                f"model.n_heads: {h} does not divide model.d_model: {d}; "
                "allowed: d_model a positive multiple of n_heads"
            )


def _merge(base: dict[str, Any], raw: dict[str, Any]) -> None:
    """Overlay only the keys the YAML file really sets; ``phases`` is replaced whole."""

    def deep(dst: dict[str, Any], src: dict[str, Any]) -> None:
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict) and k not in ("phases",):
                deep(dst[k], v)
            else:
                dst[k] = v

    deep(base, raw)
