"""Hyperparameter scaling with the number of GPUs (``hpc scale``).

The rules users apply by hand today: ``linear`` (lr and warmup times the GPU
count), ``sqrt`` (times its square root, for very large batches), ``cap:N``
(linear until the factor reaches N, then flat; N >= 1) and ``none``. The
effective batch is always ``batch_size * accum * gpus``.

The arithmetic is not here: it is :mod:`ddp.scaling`, the module the trainer's
``TrainConfig`` uses, so this table and the job's log line cannot disagree.
``ddp.scaling`` imports only the standard library, and it is imported inside
the functions below, so ``import hpc`` still pulls neither ``ddp`` nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc.errors import UserError

if TYPE_CHECKING:
    from ddp.scaling import Rule


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    gpus: int
    effective_batch: int
    factor: float
    lr: float
    warmup: int


def parse_rule(rule: str) -> Rule:
    """'none' | 'linear' | 'sqrt' | 'cap:N' -> the shared Rule; a UserError otherwise."""
    from ddp.scaling import ScalingRuleError
    from ddp.scaling import parse_rule as parse

    try:
        return parse(rule)
    except ScalingRuleError as exc:
        raise UserError(f"rule: {exc}") from None


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
    gpus: int,
    rule: str,
    base_lr: float,
    base_warmup: int,
    batch_size: int,
    accum: int,
    base_gpus: int = 1,
    by: str = "world",
    base_batch: int = 0,
) -> list[Row]:
    """The scaled lr, warmup and effective batch for 1..gpus GPUs, doubling.

    ``base_gpus`` is the GPU count ``base_lr`` and ``base_warmup`` were tuned at
    (``scaling.base_world_size`` in the trainer's config). With ``by="batch"`` the
    factor follows ``effective batch / base_batch`` instead (``scaling.by: batch``,
    ``scaling.base_batch_size``), the seeds' formula.
    """
    from ddp import scaling

    if by not in scaling.BY:
        raise UserError(f"by: {by!r} is not allowed; allowed: {', '.join(scaling.BY)}")
    if by == "world" and base_batch:
        raise UserError(
            f"base-batch: {base_batch} is used only with --by batch; allowed: add "
            "--by batch, or leave --base-batch out"
        )
    if by == "batch" and base_batch < 1:
        raise UserError(
            f"base-batch: {base_batch} is not allowed; allowed: a whole number >= 1 "
            "(the effective batch base-lr was tuned for) with --by batch"
        )

    for name, value in (
        ("base-warmup", base_warmup),
        ("batch-size", batch_size),
        ("accum", accum),
        ("base-gpus", base_gpus),
    ):
        if value < (0 if name == "base-warmup" else 1):
            low = 0 if name == "base-warmup" else 1
            raise UserError(f"{name}: {value} is not allowed; allowed: a whole number >= {low}")
    if not base_lr > 0:
        raise UserError(f"base-lr: {base_lr} is not allowed; allowed: a number > 0")
    parsed = parse_rule(rule)
    rows = []
    for n in gpu_counts(gpus):
        eff = scaling.effective_batch(batch_size, accum, n)
        f = parsed.factor(n, base_gpus) if by == "world" else parsed.of_ratio(eff / base_batch)
        rows.append(
            Row(n, eff, f, scaling.scaled_lr(base_lr, f), scaling.scaled_warmup(base_warmup, f))
        )
    return rows
