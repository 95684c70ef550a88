"""A sweep's grid: ``--sweep KEY=V1,V2 [--sweep KEY2=...]`` parsed, checked and expanded to
the cartesian product of :class:`SweepTask` (each with its label and task folder name).
:mod:`hpc.sweep` writes them to ``sweep.json`` and re-exports every name here."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from hpc._util import NAME
from hpc.errors import UserError

MAX_TASKS = 20_000
"""Most tasks one sweep may expand to: past this a typo (an extra value list) is likelier
than intent. It is no scheduler's array size: a sweep wider than the cluster's array
limit (SLURM's ``MaxArraySize``, PBS's ``max_array_size``, read at submit) is split
into several arrays (:func:`split`)."""
MAX_DIRNAME = 64
MAX_VALUE = 256

# A trainer config key: dotted names, as ``--set optim.lr=...`` takes them.
_KEY = rf"{NAME}(?:\.{NAME})*\Z"
_KEY_HELP = "a dotted config key such as optim.lr"


class SweepTask(NamedTuple):
    """One point of the sweep; ``index`` is its array index (0-based)."""

    # The field shadows tuple.index (never called on a task); the manifest's key is "index".
    index: int  # type: ignore[assignment]
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
            raise UserError(
                f"--sweep {item!r}: no '='; allowed: KEY=V1,V2,... e.g. optim.lr=0.1,0.01"
            )
        if not key:
            raise UserError(f"--sweep {item!r}: empty key; allowed: {_KEY_HELP}")
        if not re.match(_KEY, key):
            raise UserError(
                f"--sweep {item!r}: key {key!r} is not a config key; allowed: {_KEY_HELP}"
            )
        if key in seen:
            raise UserError(
                f"--sweep {item!r}: key {key!r} given twice; allowed: each key once "
                "(list all its values in one --sweep)"
            )
        seen.add(key)
        if not rest.strip():
            raise UserError(f"--sweep {item!r}: no values; allowed: KEY=V1,V2,...")
        values = [v.strip() for v in rest.split(",")]
        for pos, value in enumerate(values, 1):
            _check_value(value, f"--sweep {item!r}: value {pos}")
        dup = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if dup is not None:
            raise UserError(
                f"--sweep {item!r}: value {dup!r} given twice; allowed: distinct values"
            )
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
