"""``python -m ddp RECIPE [--config FILE] [--set section.key=value ...] [recipe flags]``.

Runs the same way as one process, under torchrun, mpiexec or srun: ``ddp.init()``
works out the launcher. User mistakes (ConfigError) end with one stderr line
``ddp: error: ...`` and exit code 2; a preempted run exits with
``ddp.trainer.PREEMPTED_EXIT_CODE`` (75) after saving its checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ddp.errors import ConfigError

if TYPE_CHECKING:
    from ddp.config import TrainConfig
    from ddp.recipes import Recipe


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ddp",
        description="Train a recipe with DDP under any launcher.",
        epilog="Recipe flags: python -m ddp RECIPE --help",
    )
    p.add_argument("recipe", nargs="?", help="recipe name (see --list)")
    p.add_argument("--list", action="store_true", help="list recipes and exit")
    p.add_argument("--config", help="YAML config (sections as in configs/RECIPE.yaml)")
    p.add_argument(
        "--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
        help="override config keys, e.g. --set optim.lr=1e-4 training.epochs=2 (repeatable)",
    )  # fmt: skip
    p.add_argument("--print-config", action="store_true", help="print resolved config, exit")
    p.add_argument("--debug", action="store_true", help="show tracebacks for config errors")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from ddp import recipes

    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = _parser().parse_known_args(argv)
    debug = pre.debug
    try:
        if pre.list:
            for name in recipes.names():
                try:
                    about = recipes.get(name).DESCRIPTION
                except ImportError as exc:  # a recipe's optional dependency is missing
                    about = f"(unavailable: {exc})"
                print(f"{name:10s} {about}")
            return 0
        if not pre.recipe:
            _parser().print_usage(sys.stderr)
            raise ConfigError("a recipe name is required (see --list)")
        recipe = recipes.get(pre.recipe)
        parser = _parser()
        recipes.add_flags(parser, recipe)
        args = parser.parse_args(argv)
        config = recipes.resolve(recipe, args.config, args.set, args)
        if args.print_config:
            print(config.to_yaml(), end="")
            return 0
        return _train(recipe, config)
    except ConfigError as exc:
        if debug:
            raise
        print(f"ddp: error: {exc}", file=sys.stderr)
        return 2


def _train(recipe: Recipe, config: TrainConfig) -> int:
    import ddp
    from ddp.trainer import Trainer

    ddp.init(backend=config.ddp.backend, device=config.ddp.device, timeout=config.ddp.timeout_s)
    built = recipe.build(config)
    trainer = Trainer(
        built.model, built.train_data, config, built.step_fn,
        built.eval_data, built.eval_fn, built.collate_fn,
    )  # fmt: skip
    summary = trainer.fit()
    if built.after_fit is not None:
        built.after_fit(trainer, summary)
    ddp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
