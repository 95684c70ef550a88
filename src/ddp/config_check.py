"""What a config value may be: coercion to each field's type, and the range checks.

Every value, from YAML, from ``--set section.key=value`` or from a recipe flag, goes
through :func:`_build` (type by type: :func:`_coerce`, :func:`_scalar`) and then the
range checks of its section (:func:`_validate`), so a bad value is one line naming the
key, and an unknown key names the nearest valid one (:func:`_unknown`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Union, cast, get_args, get_origin, get_type_hints

from ddp import scaling
from ddp.config_sections import (
    CheckpointConfig,
    DataConfig,
    DDPConfig,
    LoggingConfig,
    MemoryConfig,
    MonitoringConfig,
    OptimConfig,
    PhaseConfig,
    PreemptionConfig,
    ScalingConfig,
    TrainingConfig,
    WandbConfig,
)
from ddp.errors import ConfigError

_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGCONT", "SIGXCPU")

# What the numbers may be beyond their meaning: what the libraries they reach can hold.
# A value past these would pass the range checks below and fail later as an
# OverflowError or a C++ type error from torch, after the process group exists.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
"""Every integer field: a 64-bit integer (torch's seeds, sizes and counts are int64)."""
MAX_SECONDS = 365 * 86400.0
"""Every duration in seconds (timeouts, grace): one year. ``timedelta`` holds 1e14 s,
C++'s milliseconds 9e15 ms, ``threading``'s waits 9e9 s; none means anything near."""
FLOAT32_MAX = 3.4028234663852886e38
"""Learning rates: torch's optimizers compute with them in float32 tensors."""
MAX_BATCH = 2**31 - 1
"""Per-rank batch size and accumulation: their product with the world size is a sample
count that Python's ``islice`` and the samplers take as a C ``ssize_t``."""
MAX_BUCKET_MB = 1e12
"""DDP's gradient bucket: torch turns it into an int64 number of bytes."""


def _unknown(where: str, key: str, valid: list[str]) -> typing.NoReturn:
    name = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    near = f"{where}.{close[0]}" if close and where else (close[0] if close else "")
    hint = f"; did you mean {near!r}?" if close else ""
    raise ConfigError(f"unknown key {name!r}{hint} (valid: {', '.join(valid)})")


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            _unknown(where, str(key), list(fields))
        path = f"{where}.{key}" if where else str(key)
        kwargs[key] = _coerce(value, hints[key], path, fields[key].metadata.get("choices"))
    obj = cls(**kwargs)
    _validate(obj, where)
    return obj


def _coerce(value: Any, tp: Any, path: str, choices: tuple[str, ...] | None = None) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise ConfigError naming ``path``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        return _coerce(value, args[0], path, choices)
    if dataclasses.is_dataclass(tp):
        return _build(cast(type, tp), {} if value is None else value, path)  # a class here
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


#: What a range check reports with: the key, its value and what is allowed (one line).
_Bad = Callable[[str, Any, str], typing.NoReturn]


def _validate(obj: Any, where: str) -> None:
    """Range checks that the type alone cannot express: those of ``obj``'s section."""

    def bad(key: str, value: Any, allowed: str) -> typing.NoReturn:
        name = f"{where}.{key}" if where else key
        raise ConfigError(f"{name}: {value!r} is not allowed; expected {allowed}")

    for cls, check in _CHECKS:
        if isinstance(obj, cls):
            check(obj, bad)
            return


def _check_training(obj: TrainingConfig, bad: _Bad) -> None:
    for k in ("batch_size", "accum"):
        if not 1 <= getattr(obj, k) <= MAX_BATCH:
            bad(k, getattr(obj, k), f"an integer from 1 to {MAX_BATCH}")
    if obj.epochs < 0:
        bad("epochs", obj.epochs, "an integer >= 0")
    for k in ("max_steps", "max_samples"):
        v = getattr(obj, k)
        if v is not None and v < 1:
            bad(k, v, "an integer >= 1 or null")


def _check_optim(obj: OptimConfig, bad: _Bad) -> None:
    if not 0 < obj.lr <= FLOAT32_MAX:
        bad("lr", obj.lr, f"a number > 0 and at most {FLOAT32_MAX:.4g} (float32)")
    if obj.weight_decay < 0:
        bad("weight_decay", obj.weight_decay, "a number >= 0")
    if obj.momentum < 0:
        bad("momentum", obj.momentum, "a number >= 0")
    if not 0 <= obj.min_lr_ratio <= 1:
        bad("min_lr_ratio", obj.min_lr_ratio, "a fraction of optim.lr in [0, 1]")
    if obj.warmup_steps < 0:
        bad("warmup_steps", obj.warmup_steps, "an integer >= 0")
    if obj.grad_clip is not None and obj.grad_clip < 0:
        bad("grad_clip", obj.grad_clip, "a number >= 0 or null")
    if len(obj.betas) != 2 or not all(0 <= b < 1 for b in obj.betas):
        bad("betas", obj.betas, "two numbers in [0, 1)")


def _check_scaling(obj: ScalingConfig, bad: _Bad) -> None:
    if obj.base_world_size < 1:
        bad("base_world_size", obj.base_world_size, "an integer >= 1")
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


def _check_memory(obj: MemoryConfig, bad: _Bad) -> None:
    f = obj.max_memory_fraction
    if f is not None and not 0 < f <= 1:
        bad("max_memory_fraction", f, "a number in (0, 1] or null")


def _check_ddp(obj: DDPConfig, bad: _Bad) -> None:
    if not 0 < obj.bucket_cap_mb <= MAX_BUCKET_MB:
        bad("bucket_cap_mb", obj.bucket_cap_mb, f"a number > 0 and at most {MAX_BUCKET_MB:g}")
    if obj.timeout_s is not None and not 0 < obj.timeout_s <= MAX_SECONDS:
        bad(
            "timeout_s",
            obj.timeout_s,
            f"seconds > 0 and at most {MAX_SECONDS:.0f} (a year), or null",
        )


def _check_data(obj: DataConfig, bad: _Bad) -> None:
    if obj.num_workers < 0:
        bad("num_workers", obj.num_workers, "an integer >= 0")


def _check_checkpoint(obj: CheckpointConfig, bad: _Bad) -> None:
    if obj.every_n_steps < 0:
        bad("every_n_steps", obj.every_n_steps, "an integer >= 0")
    if not 0 <= obj.every_s <= MAX_SECONDS:
        bad("every_s", obj.every_s, f"seconds from 0 (off) to {MAX_SECONDS:.0f} (a year)")
    if obj.keep_last < 1:
        bad("keep_last", obj.keep_last, "an integer >= 1")
    if not obj.resume:
        bad("resume", obj.resume, "auto, none or a checkpoint path")


def _check_logging(obj: LoggingConfig, bad: _Bad) -> None:
    if obj.every_n_steps < 1:
        bad("every_n_steps", obj.every_n_steps, "an integer >= 1")
    if not (obj.straggler_factor == 0 or 1 < obj.straggler_factor <= 1e6):
        bad("straggler_factor", obj.straggler_factor, "a number > 1 (at most 1e6), or 0 (off)")
    if not 1 <= obj.straggler_points <= 1_000_000:
        bad("straggler_points", obj.straggler_points, "an integer from 1 to 1000000")
    if not 0 <= obj.straggler_min_s <= MAX_SECONDS:
        bad("straggler_min_s", obj.straggler_min_s, "seconds >= 0")


def _check_wandb(obj: WandbConfig, bad: _Bad) -> None:
    if not 0 < obj.init_timeout <= MAX_SECONDS:
        bad("init_timeout", obj.init_timeout, f"seconds > 0 and at most {MAX_SECONDS:.0f}")


def _check_preemption(obj: PreemptionConfig, bad: _Bad) -> None:
    for s in obj.signals:
        if s not in _SIGNALS:
            close = difflib.get_close_matches(s, _SIGNALS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            bad("signals", s, f"signal names among {', '.join(_SIGNALS)}{hint}")
    if obj.check_every_n_steps < 1:
        bad("check_every_n_steps", obj.check_every_n_steps, "an integer >= 1")
    if not 0 <= obj.check_interval_s <= 10:
        bad("check_interval_s", obj.check_interval_s, "seconds in [0, 10]")
    if not 0 <= obj.grace_s <= MAX_SECONDS:
        bad("grace_s", obj.grace_s, f"seconds from 0 (no watchdog) to {MAX_SECONDS:.0f} (a year)")


def _check_monitoring(obj: MonitoringConfig, bad: _Bad) -> None:
    for k, low in (("sample_frequency", 0), ("num_samples", 1), ("sample_steps", 1)):
        if getattr(obj, k) < low:
            bad(k, getattr(obj, k), f"an integer >= {low}")


def _check_phase(obj: PhaseConfig, bad: _Bad) -> None:
    if obj.epochs is not None and obj.epochs < 0:
        bad("epochs", obj.epochs, "an integer >= 0")
    if obj.lr is not None and not 0 < obj.lr <= FLOAT32_MAX:
        bad("lr", obj.lr, f"a number > 0 and at most {FLOAT32_MAX:.4g} (float32)")


#: Each section's range checks, in the order the sections were checked.
_CHECKS: tuple[tuple[type, Callable[[Any, _Bad], None]], ...] = (
    (TrainingConfig, _check_training),
    (OptimConfig, _check_optim),
    (ScalingConfig, _check_scaling),
    (MemoryConfig, _check_memory),
    (DDPConfig, _check_ddp),
    (DataConfig, _check_data),
    (CheckpointConfig, _check_checkpoint),
    (LoggingConfig, _check_logging),
    (WandbConfig, _check_wandb),
    (PreemptionConfig, _check_preemption),
    (MonitoringConfig, _check_monitoring),
    (PhaseConfig, _check_phase),
)
