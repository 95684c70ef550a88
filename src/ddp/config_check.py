"""What a config value may be: coercion to each field's type, and the section checks.

Every value, from YAML, from ``--set section.key=value`` or from a recipe flag, goes
through :func:`_coerce` (type by type: :func:`_scalar`) and then the checks of its
section (:func:`_validate`: each key's declared rule, :mod:`ddp.config_schema`, plus
the few rules that tie keys together), so a bad value is one line naming the key, and an
unknown key names the nearest valid one (:func:`_unknown`). A whole mapping is built by
:func:`_build`; ``--set`` on a built config is :mod:`ddp.config_set`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Union, get_args, get_origin

from ddp import scaling
from ddp.config_schema import Bad, check_declared, declared, hints

# The ceilings live beside the keys they bound; offered here as before (ddp.config too).
from ddp.config_sections import (  # noqa: F401
    FLOAT32_MAX,
    MAX_BATCH,
    MAX_BUCKET_MB,
    MAX_SECONDS,
    ScalingConfig,
)
from ddp.errors import ConfigError

INT_MIN, INT_MAX = -(2**63), 2**63 - 1
"""Every integer field: a 64-bit integer (torch's seeds, sizes and counts are int64)."""


def _unknown(where: str, key: str, valid: list[str]) -> typing.NoReturn:
    name = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    near = f"{where}.{close[0]}" if close and where else (close[0] if close else "")
    hint = f"; did you mean {near!r}?" if close else ""
    raise ConfigError(f"unknown key {name!r}{hint} (valid: {', '.join(valid)})")


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    types_ = hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            _unknown(where, str(key), list(fields))
        path = f"{where}.{key}" if where else str(key)
        kwargs[key] = _coerce(value, types_[key], path, _choices(fields[key]))
    obj = cls(**kwargs)
    _validate(obj, where)
    return obj


def _choices(f: dataclasses.Field[Any]) -> tuple[str, ...] | None:
    """The field's declared choices, checked (with the nearest spelling) on conversion."""
    decl = declared(f)
    return decl.choices if decl is not None else f.metadata.get("choices")


def _coerce(value: Any, tp: Any, path: str, choices: tuple[str, ...] | None = None) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise ConfigError naming ``path``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        return _coerce(value, args[0], path, choices)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # a section built (and checked) already: --set phases.1=...
            return value
        return _build(tp, {} if value is None else value, path)
    if origin is list:
        (item_tp,) = get_args(tp)
        if value is None:
            return []
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{path}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if (
        choices is not None
        and isinstance(value, bool)
        and ("off" if not value else "on") in choices
    ):
        value = "on" if value else "off"  # YAML 1.1 reads a bare off/on as a boolean
    out = _scalar(value, tp, path)
    if choices is not None and out not in choices:
        close = difflib.get_close_matches(str(out), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path}: {out!r} is not one of {', '.join(choices)}{hint}")
    return out


def _scalar(value: Any, tp: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return _int64(value, value, path)
        if isinstance(value, float) and value.is_integer():
            return _int64(int(value), value, path)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                f = math.nan
            if f.is_integer():
                return _int64(int(f), value, path)
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        out: float | None = None
        if isinstance(value, int | float):
            out = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            with contextlib.suppress(ValueError):
                out = float(value)
        if out is None:
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        # No field means anything by NaN or inf, and NaN passes every `x <= 0` check
        # below: refused here, once, for every float.
        if not math.isfinite(out):
            raise ConfigError(f"{path}: {value!r} is not a finite number; allowed: a real number")
        return out
    if tp is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise ConfigError(f"{path}: unsupported type {tp!r}")  # pragma: no cover


def _int64(out: int, value: Any, path: str) -> int:
    """``out`` if it is a 64-bit integer (:data:`INT_MIN`..:data:`INT_MAX`), else one line:
    every integer field goes through here, so ``1e300`` never reaches torch."""
    if not INT_MIN <= out <= INT_MAX:
        raise ConfigError(
            f"{path}: {value!r} is out of range; allowed: an integer from {INT_MIN} to {INT_MAX}"
        )
    return out


def _validate(obj: Any, where: str) -> None:
    """The checks of ``obj``'s section: each key's declared rule (:mod:`ddp.config_schema`),
    then the section's own rules that tie keys together (:data:`_CHECKS`)."""

    def bad(key: str, value: Any, allowed: str) -> typing.NoReturn:
        name = f"{where}.{key}" if where else key
        raise ConfigError(f"{name}: {value!r} is not allowed; expected {allowed}")

    check_declared(obj, bad)
    check = _CHECKS.get(type(obj))
    if check is not None:
        check(obj, bad)


def _check_scaling(obj: ScalingConfig, bad: Bad) -> None:
    """``base_batch_size`` means something only with ``by: batch``; ``rule`` is a grammar
    (``cap:N``), read by :mod:`ddp.scaling`, that bounds and choices cannot state."""
    if obj.base_batch_size < 0 or (obj.by == "batch" and obj.base_batch_size < 1):
        bad(
            "base_batch_size",
            obj.base_batch_size,
            "an integer >= 1 (the effective batch the base lr was tuned for) with by: batch",
        )
    if obj.by == "world" and obj.base_batch_size:
        bad("base_batch_size", obj.base_batch_size, "0 with by: world (set by: batch to use it)")
    try:
        scaling.parse_rule(obj.rule)
    except scaling.ScalingRuleError:
        close = difflib.get_close_matches(obj.rule, list(scaling.RULES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        bad("rule", obj.rule, f"none, linear, sqrt or cap:N with N >= 1{hint}")


#: The rules of a section that its keys' declarations cannot state (they tie keys together).
_CHECKS: dict[type, Callable[[Any, Bad], None]] = {ScalingConfig: _check_scaling}
