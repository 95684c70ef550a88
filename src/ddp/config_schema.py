"""Each config key declared once: its type and default (the dataclass field), and what else
a value must be (:class:`Key`: bounds, choices, help), from which the check and its
one-line message are both made.

A section in :mod:`ddp.config_sections` writes ``lr: float = key(1e-3, gt=0, ...)``; the
one generic check (:func:`check_declared`) reads the declaration, so the rule and the words
that tell a user about it cannot drift apart: change a bound and the message changes with
it. Only rules that tie two keys together (``scaling.base_batch_size`` with
``scaling.by``) or that follow a grammar (``scaling.rule``) stay functions, in
:mod:`ddp.config_check`.

Why a field table of our own and not pydantic, msgspec or OmegaConf: the compute side
already had typed dataclasses and a coercion that every value passes (YAML 1.1's
``"1e-4"`` strings, ``off`` read as a boolean, 64-bit integers, finite floats), and its
messages are pinned by tests and users' scripts. pydantic v2 or msgspec would bring a
second type system whose error text must be re-formatted into ours for every case, plus
a compiled dependency on every node image; OmegaConf gives dotted ``--set`` but its own
interpolation and merge rules. ``dataclasses.field(metadata=...)`` is the standard
library's own place for exactly this, costs nothing at import (torch's import dwarfs it
either way) and keeps ``TrainConfig`` a plain dataclass the trainer already uses.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

#: What a failed check reports with: the key, the value and what is allowed (one line).
Bad = Callable[[str, Any, str], typing.NoReturn]

_COUNT = {1: "one", 2: "two", 3: "three"}


@dataclass(frozen=True)
class Key:
    """What a key's value may be beyond its Python type, and what to tell a user.

    ``ge``/``gt``/``le``/``lt`` bound the meaningful range (said as ``from 1 to 8``,
    ``in (0, 1]``, ``>= 0``); ``most`` is a ceiling set by what a library can hold
    rather than by meaning (said as ``and at most X``). For a list, the bounds hold for
    each item, ``length`` is its exact size and ``items`` the names each item may be.
    ``noun`` replaces ``an integer``/``a number`` (``seconds``); ``note`` follows the
    range (``(float32)``). ``allowed`` is the whole phrase where the bounds alone would
    not say what a value means (``0 (off)``); ``ok`` is a rule bounds cannot state,
    always with ``allowed``. ``say_null`` false leaves ``or null`` out of the phrase
    (a phase's unset key falls back to the run's, which the phrase need not explain).
    """

    help: str = ""
    choices: tuple[str, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    most: float | None = None
    length: int | None = None
    items: tuple[str, ...] | None = None
    noun: str | None = None
    note: str = ""
    allowed: str | None = None
    ok: Callable[[Any], bool] | None = None
    say_null: bool = True


def key(
    default: Any = dataclasses.MISSING,
    *,
    factory: Callable[[], Any] | Any = dataclasses.MISSING,
    **declared: Any,
) -> Any:
    """A dataclass field with its :class:`Key` declaration in ``metadata["key"]``.

    ``choices`` is also kept as ``metadata["choices"]``, where the coercion reads it (a
    choice is checked, with its nearest spelling, as the value is converted).
    """
    decl = Key(**declared)
    meta: dict[str, Any] = {"key": decl}
    if decl.choices is not None:
        meta["choices"] = decl.choices
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def declared(f: dataclasses.Field[Any]) -> Key | None:
    """The declaration of field ``f`` (None for a key declared by its type alone)."""
    return f.metadata.get("key")


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """``cls``'s resolved field types, once per class (``get_type_hints`` is not cheap)."""
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """``int | None`` -> (int, True); ``list[float]`` -> (list[float], False)."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(get_args(tp))
    return tp, False


def _num(x: float) -> str:
    """A bound as a user reads it: ``31536000``, ``1e+12``, ``3.403e+38``, ``0.5``."""
    if isinstance(x, int) or (x.is_integer() and abs(x) < 1e9):
        return str(int(x))
    return f"{x:.4g}"


def phrase(decl: Key, tp: Any) -> str:
    """What ``allowed`` says for a declared key of type ``tp``, from its declaration."""
    if decl.allowed is not None:
        return decl.allowed
    base, nullable = _unwrap(tp)
    item = get_args(base)[0] if get_origin(base) is list else base
    if decl.items is not None:
        return f"{decl.noun or 'names'} among {', '.join(decl.items)}"
    noun = decl.noun or ("an integer" if item is int else "a number")
    if get_origin(base) is list:
        plural = noun.split(" ", 1)[-1] + "s"
        noun = f"{_COUNT.get(decl.length or 0, str(decl.length))} {plural}"
    lo = decl.ge if decl.ge is not None else decl.gt
    hi = decl.le if decl.le is not None else decl.lt
    if lo is not None and hi is not None:
        if item is int and decl.ge is not None and decl.le is not None:
            text = f"{noun} from {_num(lo)} to {_num(hi)}"
        else:
            left, right = "[" if decl.ge is not None else "(", "]" if decl.le is not None else ")"
            text = f"{noun} in {left}{_num(lo)}, {_num(hi)}{right}"
    elif lo is not None:
        text = f"{noun} {'>=' if decl.ge is not None else '>'} {_num(lo)}"
    elif hi is not None:
        text = f"{noun} {'<=' if decl.le is not None else '<'} {_num(hi)}"
    else:
        text = noun
    if decl.most is not None:
        text += f" and at most {_num(decl.most)}"
    if decl.note:
        text += f" {decl.note}"
    if nullable and decl.say_null:
        text += ", or null" if decl.note else " or null"
    return text


def _in_bounds(decl: Key, x: Any) -> bool:
    """Whether the number ``x`` is inside every bound ``decl`` declares."""
    return not (
        (decl.ge is not None and x < decl.ge)
        or (decl.gt is not None and x <= decl.gt)
        or (decl.le is not None and x > decl.le)
        or (decl.lt is not None and x >= decl.lt)
        or (decl.most is not None and x > decl.most)
    )


def check_value(decl: Key, value: Any, tp: Any) -> tuple[Any, str] | None:
    """``None`` if ``value`` (already of type ``tp``) is allowed, else what to report: the
    offending value (the item, for a list of names) and the allowed phrase."""
    if value is None:
        return None  # the type allowed null (a non-null key never holds None here)
    if decl.ok is not None and not decl.ok(value):
        return value, phrase(decl, tp)
    if isinstance(value, list):
        if decl.items is not None:
            for item in value:
                if item not in decl.items:
                    close = difflib.get_close_matches(str(item), decl.items, n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    return item, phrase(decl, tp) + hint
        if (decl.length is not None and len(value) != decl.length) or not all(
            _in_bounds(decl, x) for x in value
        ):
            return value, phrase(decl, tp)
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not _in_bounds(decl, value):
            return value, phrase(decl, tp)
    return None


def check_declared(obj: Any, bad: Bad) -> None:
    """Every declared rule of the section ``obj``, in field order; ``bad`` reports the first
    value that breaks one (and raises)."""
    types_ = hints(type(obj))
    for f in dataclasses.fields(obj):
        decl = declared(f)
        if decl is None:
            continue
        problem = check_value(decl, getattr(obj, f.name), types_[f.name])
        if problem is not None:
            bad(f.name, problem[0], problem[1])


_TYPE_WORDS = {bool: "true or false", str: "a string", int: "an integer", float: "a number"}
_PLURALS = {str: "strings", int: "integers", float: "numbers"}


def _allowed_words(decl: Key | None, tp: Any) -> str:
    """What a key allows, in the words its error would use (its type's, if undeclared)."""
    base, nullable = _unwrap(tp)
    if decl is not None and decl.choices is not None:
        return "one of " + ", ".join(decl.choices)
    if decl is not None and (
        decl.allowed is not None
        or any(b is not None for b in (decl.ge, decl.gt, decl.le, decl.lt, decl.most))
        or decl.length is not None
        or decl.items is not None
    ):
        return phrase(decl, tp)
    if get_origin(base) is dict:
        words = "a mapping: the recipe's keys (python -m ddp RECIPE --help)"
    elif get_origin(base) is list:
        words = "a list of " + _PLURALS.get(get_args(base)[0], "values")
    else:
        words = _TYPE_WORDS.get(base, str(base))
    return words + (" or null" if nullable else "")


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per key of ``cls`` and of its sections, from the declarations alone:
    ``optim.lr: 0.001  # a number > 0 and at most 3.403e+38 (float32)`` (the allowed
    words are the ones its error would use), then the key's help. ``python -m ddp --keys``
    prints them, so the reference a user reads is the schema the check runs."""
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        tp = hints(cls)[f.name]
        base, _ = _unwrap(tp)
        name = prefix + f.name
        if isinstance(base, type) and dataclasses.is_dataclass(base):
            lines += describe(base, f"{name}.")
            continue
        item = get_args(base)[0] if get_origin(base) is list else None
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            lines += describe(item, f"{name}.N.")  # phases.N.lr: one list element's keys
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        decl = declared(f)
        text = f"{name}: {json.dumps(default)}  # {_allowed_words(decl, tp)}"
        lines.append(text + (f"; {decl.help}" if decl is not None and decl.help else ""))
    return lines
