"""Hyperparameter scaling with the number of GPUs (``hpc scale``).

The rules users apply by hand today: ``linear`` (lr and warmup times the GPU
count), ``sqrt`` (times its square root, for very large batches) and ``cap:N``
(linear up to N, then flat). The effective batch is always
``batch_size * accum * gpus``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpc.errors import UserError


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    gpus: int
    effective_batch: int
    factor: float
    lr: float
    warmup: int


def parse_rule(rule: str) -> tuple[str, int | None]:
    """'linear' | 'sqrt' | 'cap:N' -> (kind, cap)."""
    if rule in ("linear", "sqrt"):
        return rule, None
    if rule.startswith("cap:") and rule[4:].isdigit() and int(rule[4:]) >= 1:
        return "cap", int(rule[4:])
    raise UserError(f"rule: {rule!r} is not a scaling rule; allowed: linear, sqrt, cap:N (N >= 1)")


def factor(kind: str, cap: int | None, gpus: int) -> float:
    """How much lr and warmup grow at ``gpus`` GPUs."""
    if kind == "linear":
        return float(gpus)
    if kind == "sqrt":
        return math.sqrt(gpus)
    return float(min(gpus, cap or gpus))


def gpu_counts(gpus: int) -> list[int]:
    """1, 2, 4, ... up to ``gpus`` (and ``gpus`` itself when not a power of two)."""
    if gpus < 1:
        raise UserError(f"gpus: {gpus} is not allowed; allowed: a whole number >= 1")
    counts, n = [], 1
    while n <= gpus:
        counts.append(n)
        n *= 2
    if counts[-1] != gpus:
        counts.append(gpus)
    return counts


def table(
    gpus: int, rule: str, base_lr: float, base_warmup: int, batch_size: int, accum: int
) -> list[Row]:
    """The scaled lr, warmup and effective batch for 1..gpus GPUs, doubling."""
    for name, value in (("base-warmup", base_warmup), ("batch-size", batch_size), ("accum", accum)):
        if value < (0 if name == "base-warmup" else 1):
            raise UserError(f"{name}: {value} is not allowed; allowed: a whole number >= 1")
    if not base_lr > 0:
        raise UserError(f"base-lr: {base_lr} is not allowed; allowed: a number > 0")
    kind, cap = parse_rule(rule)
    rows = []
    for n in gpu_counts(gpus):
        f = factor(kind, cap, n)
        rows.append(Row(n, batch_size * accum * n, f, base_lr * f, round(base_warmup * f)))
    return rows
