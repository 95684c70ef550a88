"""Sweeps: ``--sweep KEY=V1,V2 [--sweep KEY2=...]`` as one job array.

The submit side parses the flags, expands them to the cartesian product and writes
``sweep.json`` into the run directory; each array task reads it back at runtime by its
array index and runs the trainer with ``--set KEY=VALUE`` for its overrides, in its own
task directory. Values stay strings: the trainer's ``--set`` parses and checks them,
so a sweep value means exactly what the same ``--set`` on the command line would.

The manifest is read inside a job from a shared file system, so it is treated as
untrusted input: every field is checked and every problem is one line.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from hpc.errors import UserError

MANIFEST = "sweep.json"
VERSION = 1
MAX_TASKS = 20_000
"""Most tasks one sweep may expand to: past this a typo (an extra value list) is likelier
than intent. It is no scheduler's array size: a sweep wider than the cluster's array
limit (SLURM's ``MaxArraySize``, PBS's ``max_array_size``, read at submit) is split
into several arrays (:func:`split`)."""
MAX_DIRNAME = 64
MAX_VALUE = 256
MAX_MANIFEST_BYTES = 16 * 1024 * 1024  # MAX_TASKS tasks of a few hundred bytes each
def array_index_vars() -> tuple[str, ...]:
    """Each scheduler's array-task variable (``Scheduler.array_index_var``), from the
    schedulers themselves: a new scheduler module brings its own."""
    from hpc import schedulers

    found = (schedulers.get(name).array_index_var for name in schedulers.names())
    return tuple(var for var in found if var)
"""Where a task finds its array index: SLURM, then PBS Pro/OpenPBS (both 0-based here:
the array is submitted as ``0-(N-1)``)."""

# A trainer config key: dotted names, as ``--set optim.lr=...`` takes them.
_KEY = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\Z"
_KEY_HELP = "a dotted config key such as optim.lr"


class SweepTask(NamedTuple):
    """One point of the sweep; ``index`` is its array index (0-based)."""

    index: int
    overrides: dict[str, str]
    label: str
    """``KEY=VALUE KEY2=VALUE2``: names the task in logs and report legends."""
    dirname: str
    """The task's directory under the run directory (safe on any file system)."""


def parse(items: Iterable[str]) -> list[tuple[str, list[str]]]:
    """``["optim.lr=0.1,0.01", ...]`` -> ``[("optim.lr", ["0.1", "0.01"]), ...]``, in order.

    Refuses what would silently make a different sweep than meant: an empty key or
    value list, an empty item (``0.1,,0.2``: a stray comma), a key or value given twice,
    and more than :data:`MAX_TASKS` tasks in all (checked before anything is expanded).
    """
    parsed: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for item in items:
        key, sep, rest = str(item).partition("=")
        key = key.strip()
        if not sep:
            raise UserError(f"--sweep {item!r}: no '='; allowed: KEY=V1,V2,... e.g. optim.lr=0.1,0.01")
        if not key:
            raise UserError(f"--sweep {item!r}: empty key; allowed: {_KEY_HELP}")
        if not re.match(_KEY, key):
            raise UserError(f"--sweep {item!r}: key {key!r} is not a config key; allowed: {_KEY_HELP}")
        if key in seen:
            raise UserError(f"--sweep {item!r}: key {key!r} given twice; allowed: each key once "
                            "(list all its values in one --sweep)")  # fmt: skip
        seen.add(key)
        if not rest.strip():
            raise UserError(f"--sweep {item!r}: no values; allowed: KEY=V1,V2,...")
        values = [v.strip() for v in rest.split(",")]
        for pos, value in enumerate(values, 1):
            _check_value(value, f"--sweep {item!r}: value {pos}")
        dup = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if dup is not None:
            raise UserError(f"--sweep {item!r}: value {dup!r} given twice; allowed: distinct values")
        parsed.append((key, values))
    if not parsed:
        raise UserError("--sweep: nothing to sweep; allowed: --sweep KEY=V1,V2,... (repeatable)")
    total = math.prod(len(vs) for _, vs in parsed)
    if total > MAX_TASKS:
        sizes = " x ".join(str(len(vs)) for _, vs in parsed)
        raise UserError(f"--sweep: {sizes} = {total} tasks; allowed: at most {MAX_TASKS}")
    return parsed


def _check_value(value: str, where: str) -> None:
    if not value:
        raise UserError(f"{where} is empty (a stray comma?); allowed: non-empty values")
    if len(value) > MAX_VALUE:
        raise UserError(f"{where} has {len(value)} characters; allowed: at most {MAX_VALUE}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UserError(f"{where} {value!r} holds a control character; allowed: printable text")


def expand(parsed: list[tuple[str, list[str]]]) -> list[SweepTask]:
    """The cartesian product, the last key varying fastest (as nested loops would)."""
    import itertools

    keys = [k for k, _ in parsed]
    tasks = []
    for index, combo in enumerate(itertools.product(*(vs for _, vs in parsed))):
        overrides = dict(zip(keys, combo, strict=True))
        tasks.append(SweepTask(index, overrides, label(overrides), dirname(index, overrides)))
    return tasks


def tasks_from_flags(items: Iterable[str]) -> list[SweepTask]:
    """``parse`` then ``expand``: what ``hpc submit --sweep ...`` needs."""
    return expand(parse(items))


def label(overrides: Mapping[str, str]) -> str:
    """``optim.lr=0.1 training.batch_size=32``."""
    return " ".join(f"{k}={v}" for k, v in overrides.items())


def dirname(index: int, overrides: Mapping[str, str]) -> str:
    """``003-lr-0.1_batch_size-32``: the index keeps names unique and sorted, the rest
    is a readable hint cut to :data:`MAX_DIRNAME` characters.

    Only ``[A-Za-z0-9._-]`` survive, so no path separator, no leading dot (the index
    comes first) and nothing a shell or a scheduler's ``%`` patterns would read.
    """
    hint = "_".join(f"{k.rsplit('.', 1)[-1]}-{v}" for k, v in overrides.items())
    hint = re.sub(r"[^A-Za-z0-9._-]+", "_", hint).strip("._-")
    name = f"{index:03d}-{hint}" if hint else f"{index:03d}"
    return name[:MAX_DIRNAME].rstrip("._-")


def _safe_dirname(name: str) -> bool:
    return (
        0 < len(name) <= MAX_DIRNAME
        and re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", name) is not None
    )


def check_max_parallel(value: Any, n_tasks: int) -> int:
    """How many tasks may run at once (SLURM ``--array=0-N%M``): 1 .. number of tasks."""
    text = str(value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[0-9]{1,6}", text):  # not \d: ١٢٣
        raise UserError(f"--max-parallel: {str(value)!r} is not a number; "
                        f"allowed: 1 to {n_tasks} (the number of tasks)")  # fmt: skip
    number = int(text)
    if not 1 <= number <= n_tasks:
        raise UserError(f"--max-parallel: {number}; allowed: 1 to {n_tasks} (the number of tasks)")
    return number


def split(n_tasks: int, limit: int | None) -> list[tuple[int, int]]:
    """``(offset, count)`` of each array a sweep of ``n_tasks`` is submitted as, where one
    array may hold at most ``limit`` tasks (indices ``0 .. limit-1``).

    Why offsets and not index ranges: SLURM's ``MaxArraySize`` caps the array *index*
    ("the maximum job array task index value will be one less than MaxArraySize",
    slurm.conf(5)), so ``--array=1001-2000`` is refused at the default 1001 just as
    ``--array=0-1999`` is. Every part is therefore ``0 .. count-1``, and a task finds its
    place in the sweep as ``offset + SLURM_ARRAY_TASK_ID`` (the offset is the part
    script's first argument, or ``$HPC_SWEEP_OFFSET`` under PBS: the scheduler's
    ``array_offset_word``, read by ``python -m hpc.sweep shell ... --offset``). PBS caps the
    count instead (``max_array_size``, see ``hpc.schedulers.pbs``); the same parts fit.

    No part of one task where the limit allows it: PBS refuses an array of one subjob
    (``qsub -J 0-0``: "qsub: illegal -J value", seen on OpenPBS 23.06; its range parser
    wants start < end, src/lib/Libutil/range.c ``parse_subjob_index``), so a lone last
    task joins the part before it, which gives one up (``(0, 5), (5, 4), (9, 2)`` for 11
    tasks at 5). SLURM takes either.
    """
    if limit is None or n_tasks <= limit:
        return [(0, n_tasks)]
    parts = [(start, min(limit, n_tasks - start)) for start in range(0, n_tasks, limit)]
    if parts[-1][1] == 1 and limit >= 3:
        (before, count), (last, _) = parts[-2], parts[-1]
        parts[-2:] = [(before, count - 1), (last - 1, 2)]
    return parts


def throttle(n_tasks: int, max_parallel: int | None, limit: int | None, where: str
             ) -> tuple[int | None, str | None]:
    """``(max_parallel, note)`` for an array of ``n_tasks`` in a queue that lets at most
    ``limit`` subjobs be queued or running at once (the profile's ``array_limit``).

    Why: PBS accepts an array wider than Polaris' ``prod`` routing limit, and the
    subjobs past it "sit forever without running" (ALCF, "Limits on job arrays"). With
    no ``--max-parallel`` the array is throttled to the limit (``-J 0-14%10``) and the
    note says so once. An explicit ``--max-parallel`` above it is refused in one line
    rather than clamped: the user asked for a number, the site cannot honour it, and a
    refusal before anything is written costs nothing, where a silent clamp would run a
    different sweep than the one asked for (and a clamp with a message is still a
    request overruled).
    """
    if limit is None or n_tasks <= limit:
        return max_parallel, None
    if max_parallel is None:
        return limit, (f"hpc: {where} runs at most {limit} subjobs of an array at once; the "
                       f"sweep's {n_tasks} tasks run {limit} at a time (%{limit})")
    if max_parallel > limit:
        raise UserError(f"--max-parallel: {max_parallel}; {where} runs at most {limit} subjobs "
                        f"of an array at once (the others would wait forever); allowed: 1 to "
                        f"{limit}")  # fmt: skip
    return max_parallel, None


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
        raise UserError(f"sweep: {str(path)!r} does not exist; allowed: a run directory "
                        "made by hpc submit --sweep")  # fmt: skip
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
        raise UserError(f"{where}: max_parallel {max_parallel!r}; allowed: null or 1 "
                        f"to {len(raw_tasks)}")  # fmt: skip
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
            raise UserError(f"{at}: label {raw['label']!r} holds a control character; "
                            "allowed: printable text")  # fmt: skip
        name = raw["dirname"]
        if not isinstance(name, str) or not _safe_dirname(name):
            raise UserError(f"{at}: dirname {name!r}; allowed: 1 to {MAX_DIRNAME} of "
                            "[A-Za-z0-9._-], not starting with a dot")  # fmt: skip
        if name in names:
            raise UserError(f"{at}: dirname {name!r} is used twice; allowed: one per task")
        names.add(name)
        tasks.append(SweepTask(pos, dict(overrides), raw["label"], name))
    return tasks


def array_index(index: int | str | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The task's array index: ``index`` if given, else the scheduler's variable."""
    env = os.environ if environ is None else environ
    where = "--index"
    if index is None:
        names = array_index_vars()
        for var in names:
            if env.get(var, "").strip():
                index, where = env[var], f"${var}"
                break
        else:
            raise UserError("sweep: no array index; allowed: --index N, or run as an array task "
                            f"({' or '.join('$' + v for v in names)} set)")  # fmt: skip
    text = str(index).strip()
    if isinstance(index, bool) or not re.fullmatch(r"[0-9]{1,6}", text):
        raise UserError(f"sweep: {where} {str(index)!r} is not an array index; "
                        "allowed: a whole number from 0 to 999999 in ASCII digits")  # fmt: skip
    return int(text)


def task_for(
    run_dir: Path, index: int | str | None = None, environ: Mapping[str, str] | None = None,
    offset: int | str | None = None,
) -> SweepTask:
    """This array task's entry of ``run_dir/sweep.json`` (see :func:`array_index`): the
    one at ``offset`` + its index, where the sweep was split into several arrays."""
    tasks = read_manifest(run_dir)
    i = array_index(index, environ) + _offset(offset)
    if i >= len(tasks):
        raise UserError(f"sweep: array index {i} is past the {len(tasks)} tasks of "
                        f"{str(run_dir / MANIFEST)!r}; allowed: 0 to {len(tasks) - 1}")  # fmt: skip
    return tasks[i]


def _offset(offset: int | str | None) -> int:
    """``--offset`` as the part's submit command gave it ("" or None: 0, the first or
    only array); ASCII digits only, as :func:`array_index` takes an index."""
    text = "" if offset is None else str(offset).strip()
    if not text:
        return 0
    if isinstance(offset, bool) or not re.fullmatch(r"[0-9]{1,6}", text):
        raise UserError(f"sweep: --offset {str(offset)!r} is not an array offset; "
                        "allowed: a whole number from 0 to 999999 in ASCII digits")  # fmt: skip
    return int(text)


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
    """``raw`` as the trainer's ``--set`` parses it (YAML): None for no folder at all."""
    import yaml

    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return None if value in _NO_FOLDER else str(value)


def check_checkpoint_dirs(command: Iterable[str], tasks: Iterable[SweepTask], run_dir: Path) -> None:
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
            source = ("its --sweep values" if CHECKPOINT_KEY in task.overrides
                      else "the command")  # fmt: skip
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

        def error(self, message: str) -> Any:  # type: ignore[override]
            raise UserError(f"{message}; allowed: shell RUN_DIR [--index N] [--offset K]")

    parser = Parser(prog="python -m hpc.sweep")
    parser.add_argument("action", choices=["shell"])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--index", default=None, help="array index (default: the scheduler's)")
    parser.add_argument("--offset", default=None,
                        help="this array's first task in the sweep (a sweep split into arrays)")
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
