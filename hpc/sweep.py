"""Sweeps: ``--sweep KEY=V1,V2 [--sweep KEY2=...]`` as one job array.

The submit side parses the flags, expands them to the cartesian product and writes
``sweep.json`` into the run directory; each array task reads it back at runtime by its
array index and runs the trainer with ``--set KEY=VALUE`` for its overrides, in its own
task directory. Values stay strings: the trainer's ``--set`` parses and checks them,
so a sweep value means exactly what the same ``--set`` on the command line would.

The manifest is read inside a job from a shared file system, so it is treated as
untrusted input: every field is checked and every problem is one line.

This module is the manifest, the checkpoint-folder check and what an array task evals
(``python -m hpc.sweep shell``); the grid (``--sweep`` parsed and expanded) is
:mod:`hpc.sweep_grid`, the arrays (split, throttle, a task's index) :mod:`hpc.sweep_array`.
Every name of the three is importable from here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from hpc.errors import UserError
from hpc.sweep_array import (
    _offset,
    array_index,
    array_index_vars,
    check_max_parallel,
    split,
    throttle,
)
from hpc.sweep_grid import (
    _KEY,
    _KEY_HELP,
    MAX_DIRNAME,
    MAX_TASKS,
    MAX_VALUE,
    SweepTask,
    _check_value,
    _safe_dirname,
    dirname,
    expand,
    label,
    parse,
    tasks_from_flags,
)

__all__ = [
    "CHECKPOINT_KEY",
    "MANIFEST",
    "MAX_DIRNAME",
    "MAX_MANIFEST_BYTES",
    "MAX_TASKS",
    "MAX_VALUE",
    "VERSION",
    "SweepTask",
    "array_index",
    "array_index_vars",
    "check_checkpoint_dirs",
    "check_max_parallel",
    "command_setting",
    "dirname",
    "expand",
    "label",
    "main",
    "parse",
    "read_manifest",
    "read_sweep",
    "set_args",
    "shell",
    "split",
    "task_dir",
    "task_for",
    "tasks_from_flags",
    "throttle",
    "write_manifest",
]

MANIFEST = "sweep.json"
VERSION = 1
MAX_MANIFEST_BYTES = 16 * 1024 * 1024  # MAX_TASKS tasks of a few hundred bytes each


def write_manifest(run_dir: Path, tasks: list[SweepTask], max_parallel: int | None = None) -> Path:
    """Write ``run_dir/sweep.json`` all or nothing (mkstemp + ``os.replace``): a task
    starting while a resubmission rewrites it reads the old or the new one, never half."""
    from hpc._util import write_atomic

    data: dict[str, Any] = {
        "version": VERSION,
        "max_parallel": max_parallel,
        "tasks": [t._asdict() for t in tasks],
    }
    _check_manifest(data, run_dir / MANIFEST)  # what we write must read back
    path = run_dir / MANIFEST
    write_atomic(path, json.dumps(data, indent=2) + "\n", "sweep")
    return path


def read_manifest(run_dir: Path) -> list[SweepTask]:
    """The tasks of ``run_dir/sweep.json``, each field checked; any problem is one line."""
    return read_sweep(run_dir)[0]


def read_sweep(run_dir: Path) -> tuple[list[SweepTask], int | None]:
    """The tasks of ``run_dir/sweep.json`` and the ``--max-parallel`` it was submitted
    with (kept by a resubmission), from one read; every field checked."""
    from hpc._util import read_regular

    path = run_dir / MANIFEST
    if not os.path.lexists(path):
        raise UserError(
            f"sweep: {str(path)!r} does not exist; allowed: a run directory "
            "made by hpc submit --sweep"
        )
    # Regular files only, opened non-blocking and read with a bound: a FIFO there would
    # hang every array task (and `hpc report`) in open(), /dev/zero would never end.
    raw = read_regular(path, "sweep", MAX_MANIFEST_BYTES)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"sweep: {str(path)!r} is not JSON ({reason})") from None
    tasks = _check_manifest(data, path)
    return tasks, data.get("max_parallel")


def _check_manifest(data: Any, path: Path) -> list[SweepTask]:
    where = f"sweep: {str(path)!r}"
    if not isinstance(data, dict):
        raise UserError(f"{where} holds a {type(data).__name__}; allowed: a JSON object")
    if type(data.get("version")) is not int or data["version"] != VERSION:  # true == 1.0 == 1
        raise UserError(f"{where}: version {data.get('version')!r}; allowed: {VERSION}")
    raw_tasks = data.get("tasks")
    if not isinstance(raw_tasks, list) or not 1 <= len(raw_tasks) <= MAX_TASKS:
        raise UserError(f"{where}: 'tasks' must be a list of 1 to {MAX_TASKS} tasks")
    max_parallel = data.get("max_parallel")
    if max_parallel is not None and (
        type(max_parallel) is not int or not 1 <= max_parallel <= len(raw_tasks)
    ):
        raise UserError(
            f"{where}: max_parallel {max_parallel!r}; allowed: null or 1 to {len(raw_tasks)}"
        )
    tasks: list[SweepTask] = []
    names: set[str] = set()
    fields = set(SweepTask._fields)
    for pos, raw in enumerate(raw_tasks):
        at = f"{where}: task {pos}"
        if not isinstance(raw, dict) or set(raw) != fields:
            raise UserError(f"{at} is not an object with exactly {', '.join(SweepTask._fields)}")
        if type(raw["index"]) is not int or raw["index"] != pos:
            raise UserError(f"{at}: index {raw['index']!r}; allowed: {pos} (its position)")
        overrides = raw["overrides"]
        if not isinstance(overrides, dict) or not overrides:
            raise UserError(f"{at}: overrides must be a non-empty object of KEY: VALUE strings")
        for key, value in overrides.items():
            if not re.match(_KEY, key):
                raise UserError(f"{at}: key {key!r}; allowed: {_KEY_HELP}")
            if not isinstance(value, str):
                raise UserError(f"{at}: {key} is a {type(value).__name__}; allowed: a string")
            _check_value(value, f"{at}: {key}")
        if not isinstance(raw["label"], str) or len(raw["label"]) > 4096:
            raise UserError(f"{at}: label must be a string")
        # Exported as HPC_SWEEP_LABEL through bash's eval: a NUL is dropped there, and
        # newlines or escapes would reach every terminal that prints the label.
        if any(ord(c) < 32 or ord(c) == 127 for c in raw["label"]):
            raise UserError(
                f"{at}: label {raw['label']!r} holds a control character; allowed: printable text"
            )
        name = raw["dirname"]
        if not isinstance(name, str) or not _safe_dirname(name):
            raise UserError(
                f"{at}: dirname {name!r}; allowed: 1 to {MAX_DIRNAME} of "
                "[A-Za-z0-9._-], not starting with a dot"
            )
        if name in names:
            raise UserError(f"{at}: dirname {name!r} is used twice; allowed: one per task")
        names.add(name)
        tasks.append(SweepTask(pos, dict(overrides), raw["label"], name))
    return tasks


def task_for(
    run_dir: Path,
    index: int | str | None = None,
    environ: Mapping[str, str] | None = None,
    offset: int | str | None = None,
) -> SweepTask:
    """This array task's entry of ``run_dir/sweep.json`` (see :func:`array_index`): the
    one at ``offset`` + its index, where the sweep was split into several arrays."""
    tasks = read_manifest(run_dir)
    i = array_index(index, environ) + _offset(offset)
    if i >= len(tasks):
        raise UserError(
            f"sweep: array index {i} is past the {len(tasks)} tasks of "
            f"{str(run_dir / MANIFEST)!r}; allowed: 0 to {len(tasks) - 1}"
        )
    return tasks[i]


CHECKPOINT_KEY = "checkpoint.dir"
"""The trainer's checkpoint folder: relative paths are taken from ``$HPC_RUN_DIR``."""
_NO_FOLDER = (None, "")  # --set checkpoint.dir=null (or empty): no checkpoints at all


def command_setting(command: Iterable[str], key: str) -> str | None:
    """The last ``KEY=VALUE`` the command's words give (``--set K=V``, ``--set=K=V``, or
    inside a ``bash -c`` string), as the trainer's ``--set`` reads it: later wins."""
    found = None
    for word in command:
        for part in str(word).split():
            part = part.removeprefix("--set=")
            name, sep, value = part.partition("=")
            if sep and name == key:
                found = value
    return found


def _folder_value(raw: str) -> str | None:
    """``raw`` as the trainer's ``--set`` parses it (the one strict YAML,
    :mod:`hpc_ddp.strict_yaml`, as ``ddp.yaml_io`` reads it): None for no folder at all."""
    import yaml

    from hpc_ddp import strict_yaml

    try:
        value = strict_yaml.load(raw, "config") if raw.strip() else ""
    except (yaml.YAMLError, strict_yaml.Refused, RecursionError):
        value = raw
    return None if value in _NO_FOLDER else str(value)


def check_checkpoint_dirs(
    command: Iterable[str], tasks: Iterable[SweepTask], run_dir: Path
) -> None:
    """Each sweep task checkpoints in a folder of its own, or the sweep is refused.

    The trainer takes a relative ``checkpoint.dir`` (its default ``checkpoints``) from
    the task's folder, so each task has its own. One given in the command as an absolute
    path, or one that climbs out (``../shared``), is the same folder for every task: task
    1 would find task 0's checkpoint, resume it at its last step, train 0 steps and end
    COMPLETED. That is asking the tasks to share, which a sweep cannot honour: refused
    at submit, naming the value. Sweeping ``checkpoint.dir`` itself is fine as long as
    the combinations still give every task its own folder.
    """
    given = command_setting(command, CHECKPOINT_KEY)
    owners: dict[str, SweepTask] = {}
    for task in tasks:
        raw = task.overrides.get(CHECKPOINT_KEY, given)
        value = None if raw is None else _folder_value(raw)
        if value is None:
            continue
        base = os.path.abspath(task_dir(run_dir, task))
        folder = os.path.normpath(os.path.join(base, value))  # an absolute value wins
        first = owners.setdefault(folder, task)
        if first is not task:
            source = "its --sweep values" if CHECKPOINT_KEY in task.overrides else "the command"
            raise UserError(
                f"--sweep: {CHECKPOINT_KEY}={raw} ({source}) gives tasks {first.index} and "
                f"{task.index} the same checkpoint folder {folder!r}: task {task.index} would "
                f"resume task {first.index}'s checkpoint and train 0 steps; allowed: no "
                f"{CHECKPOINT_KEY} (each task checkpoints in its own folder), a relative one "
                "inside the task's folder, or a --sweep of it with one folder per task"
            )


def set_args(task: SweepTask) -> list[str]:
    """The trainer arguments for ``task``: ``["--set", "K=V", "K2=V2"]`` (argv, no shell)."""
    return ["--set", *(f"{k}={v}" for k, v in task.overrides.items())]


def task_dir(run_dir: Path, task: SweepTask) -> Path:
    """Where the task keeps its metrics, checkpoints and log: its ``HPC_RUN_DIR``."""
    return run_dir / task.dirname


def shell(run_dir: Path, task: SweepTask) -> str:
    """Bash that a job array's task ``eval``s to become its task (every value quoted).

    Sets ``HPC_RUN_DIR`` to the task's directory (made here: the trainer's metrics and
    checkpoints go there, so tasks never share them), ``HPC_SWEEP_KEYS`` to the keys its
    overrides set (the trainer's own check of ``checkpoint.dir`` reads it) and
    ``HPC_SWEEP_ARGS``, the array to append to the trainer's command line:
    ``python -m ddp ... "${HPC_SWEEP_ARGS[@]}"``.
    """
    import shlex

    path = task_dir(run_dir, task)
    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        raise UserError(f"sweep: cannot create {str(path)!r}: {exc.strerror}") from None
    return (
        f"export HPC_RUN_DIR={shlex.quote(str(path))}\n"
        f"export HPC_SWEEP_INDEX={task.index}\n"
        f"export HPC_SWEEP_LABEL={shlex.quote(task.label)}\n"
        f"export HPC_SWEEP_KEYS={shlex.quote(','.join(task.overrides))}\n"
        f"HPC_SWEEP_ARGS=({' '.join(shlex.quote(a) for a in set_args(task))})\n"
    )


def _main(argv: list[str] | None = None) -> int:
    """``python -m hpc.sweep shell RUN_DIR [--index N] [--offset K]``: what an array task evals::

        task=$(python -m hpc.sweep shell "$HPC_RUN_DIR") || exit 2
        eval "$task"

    in two steps: ``eval "$(...)" || exit 2`` would not stop, since ``eval ""`` succeeds.

    Run inside the job, so it imports nothing heavy; errors are one line on stderr, exit 2.
    """
    import argparse
    import sys

    class Parser(argparse.ArgumentParser):
        """Usage mistakes are one line too (argparse prints the usage, then exits)."""

        def error(self, message: str) -> NoReturn:
            raise UserError(f"{message}; allowed: shell RUN_DIR [--index N] [--offset K]")

    parser = Parser(prog="python -m hpc.sweep")
    parser.add_argument("action", choices=["shell"])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--index", default=None, help="array index (default: the scheduler's)")
    parser.add_argument(
        "--offset",
        default=None,
        help="this array's first task in the sweep (a sweep split into arrays)",
    )
    try:
        args = parser.parse_args(argv)
        task = task_for(args.run_dir, args.index, offset=args.offset)
        sys.stdout.write(shell(args.run_dir, task))
    except UserError as exc:
        sys.stderr.write(f"hpc sweep: error: {exc}\n")
        return exc.exit_code
    return 0


def main(argv: list[str] | None = None) -> int:
    """:func:`_main`, ending quietly (141) when nobody reads its output (``hpc._pipes``)."""
    from hpc._pipes import run_main

    return run_main(lambda: _main(argv))


if __name__ == "__main__":
    raise SystemExit(main())
