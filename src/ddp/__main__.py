"""``python -m ddp RECIPE [--config FILE] [--set section.key=value ...] [recipe flags]``.

Runs the same way as one process, under torchrun, mpiexec or srun: ``ddp.init()``
works out the launcher. User mistakes (ConfigError, and command-line errors such as
an unknown flag) end with one stderr line ``ddp: error: ...`` and exit code 2; a
preempted run exits with ``ddp.trainer.PREEMPTED_EXIT_CODE`` (75) after saving its
checkpoint. ``python -m ddp RECIPE --help`` lists the recipe's own flags and the common
ones, each with the config key it sets and the value that key has without it.
``DDP_SET`` in the environment adds ``--set`` items before the command line's own.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from ddp.errors import ConfigError

if TYPE_CHECKING:
    from ddp.config import TrainConfig
    from ddp.recipes import Recipe


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors: one ``ddp: error:`` line, exit 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _parser(add_help: bool = True) -> _Parser:
    p = _Parser(
        prog="python -m ddp",
        description="Train a recipe with DDP under any launcher.",
        epilog="Recipe flags, their config keys and defaults: python -m ddp RECIPE --help",
        add_help=add_help,
    )
    p.add_argument("recipe", nargs="?", help="recipe name (see --list)")
    p.add_argument("--list", action="store_true", help="list recipes and exit")
    p.add_argument(
        "--keys", action="store_true", help="list every config key, its default and range; exit"
    )
    p.add_argument("--config", help="YAML config (sections as in configs/RECIPE.yaml)")
    p.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override config keys, e.g. --set optim.lr=1e-4 training.epochs=2 (repeatable)",
    )
    p.add_argument("--print-config", action="store_true", help="print resolved config, exit")
    p.add_argument("--debug", action="store_true", help="show tracebacks for config errors")
    return p


#: Extra ``--set`` items from the environment, for a checked-in job script one cannot
#: edit per run: ``sbatch --export=ALL,DDP_SET="training.max_steps=100" jobs/x.slurm``.
ENV_SETS = "DDP_SET"


def env_sets(environ: dict[str, str] | None = None) -> list[str]:
    """``DDP_SET``'s ``KEY=VALUE`` items (shell-style words: quote a value with spaces).
    They come before the command line's ``--set``, so an explicit ``--set`` still wins."""
    raw = (os.environ if environ is None else environ).get(ENV_SETS, "")
    try:
        items = shlex.split(raw)
    except ValueError as exc:
        raise ConfigError(
            f"{ENV_SETS}: {exc}; allowed: KEY=VALUE words, quoted as in a shell"
        ) from None
    for item in items:
        if "=" not in item:
            raise ConfigError(
                f"{ENV_SETS}: {item!r} is not KEY=VALUE; allowed: section.key=value words"
            )
    return items


def _wants_help(argv: Sequence[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The command; 141, quietly, once nobody reads its output (``ddp._pipes``), but
    for a training run, which goes on without its echo and ends with its own status."""
    from ddp._pipes import run_main

    return run_main(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    from ddp import recipes

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        # Without -h: the recipe's own parser (built below) answers --help, with its flags.
        pre, _ = _parser(add_help=False).parse_known_args(argv)
        if pre.list:
            for name in recipes.names():
                try:
                    about = recipes.get(name).DESCRIPTION
                except ImportError as exc:  # a recipe's optional dependency is missing
                    about = f"(unavailable: {exc})"
                print(f"{name:10s} {about}")
            return 0
        if pre.keys:  # the declarations themselves (ddp.config_schema), not a copy of them
            from ddp.config import TrainConfig
            from ddp.config_schema import describe

            print("\n".join(describe(TrainConfig)))
            return 0
        if not pre.recipe:
            if _wants_help(argv):
                _parser().print_help()
                return 0
            raise ConfigError("a recipe name is required (see --list)")
        recipe = recipes.get(pre.recipe)
        parser = _parser()
        from_env = env_sets()
        shown = _help_config(recipe, pre.config, from_env + pre.set) if _wants_help(argv) else None
        recipes.add_flags(parser, recipe, shown)
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help printed; usage errors raise ConfigError instead
            return int(exc.code or 0)
        config = recipes.resolve(recipe, args.config, from_env + args.set, args)
        if args.print_config:
            print(config.to_yaml(), end="")
            return 0
        return _train(recipe, config, from_env)
    except ConfigError as exc:
        if debug:
            raise
        print(f"ddp: error: {exc}", file=sys.stderr)
        return 2


def _help_config(recipe: Recipe, config_file: str | None, sets: list[str]) -> TrainConfig:
    """The values --help shows as defaults: recipe defaults <- --config <- --set.

    Help should still come when the file or a --set is broken, so those fall back
    to the recipe's own defaults (the real run reports the error).
    """
    from ddp import recipes

    try:
        return recipes.resolve(recipe, config_file, sets)
    except ConfigError:
        return recipes.resolve(recipe)


def _train(recipe: Recipe, config: TrainConfig, from_env: Sequence[str] = ()) -> int:
    import ddp
    from ddp.trainer import Trainer

    ctx = ddp.init(
        backend=config.ddp.backend, device=config.ddp.device, timeout=config.ddp.timeout_s
    )
    if from_env and ctx.rank == 0:  # said once, so a log shows why a value differs
        print(f"ddp: {ENV_SETS} from the environment: {' '.join(from_env)}", file=sys.stderr)
    try:
        built = recipe.build(config)
        if config.model.get("init_from") and not built.init_done:
            from ddp import init_from

            init_from.apply(built.model, config.model["init_from"])
        trainer = Trainer(
            built.model,
            built.train_data,
            config,
            built.step_fn,
            built.eval_data,
            built.eval_fn,
            built.collate_fn,
            built.after_step,
            built.finish_eval,
        )
    except ConfigError:  # every rank reads the same input: each ends here, then says so
        ddp.shutdown()  # main() called from Python must not leave the group behind
        raise
    trainer.on_epoch_end = built.on_epoch_end
    summary = trainer.fit()
    if built.after_fit is not None:
        built.after_fit(trainer, summary)
    ddp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
