"""The one LR/warmup scaling rule, shared by the trainer's config and ``hpc scale``.

Both sides must print and apply the same numbers: a user reads the table from
``hpc scale`` on the login node and expects the job's log line (``TrainConfig``)
to say the same. So the rule lives here once, and this module imports nothing but
the standard library: ``hpc`` (which must never pull torch) imports it lazily
inside its functions, and ``ddp.config`` imports it at the top. ``import ddp``
itself does not import torch either (``tests/test_imports.py``), so that lazy
import costs ``hpc scale`` no torch.

Rules, for ``world`` ranks (GPUs) relative to ``base`` ranks (the world size the
base LR and warmup were tuned for; 1 in the seed guides):

* ``none``: factor 1;
* ``linear``: ``world / base`` (same LR per sample as the batch grows);
* ``sqrt``: ``sqrt(world / base)`` (for very large batches);
* ``cap:N``: ``min(world / base, N)`` with N a number >= 1: linear until the
  factor reaches N, then flat. With ``base = 1`` that is "linear up to N GPUs";
  seed 004's 8-GPU configuration (lr 5e-5 x 6, warmup 5000 x 6) is ``cap:6``.
  N caps the *factor*, not the GPU count, so a run tuned at ``base`` ranks never
  gets more than N times its tuned LR, whatever ``base`` is.

What grows, ``by`` (``scaling.by``; ``hpc scale --by``):

* ``world`` (the default): the ratio is ``world / base`` as above;
* ``batch``: the ratio is ``effective batch / base_batch_size``, the seeds' own
  formula (seed 003: ``New LR = Base LR x Effective Batch / Base Batch``; 16 per
  GPU on 4 GPUs against a base batch of 16 gives 4: lr 1e-4 -> 4e-4). It also
  counts a bigger per-GPU batch or more accumulation, which ``world`` cannot see.
  The rules above apply to this ratio alike (``cap:N`` caps it at N).

The scaled LR is ``lr * factor``; the scaled warmup is ``round(warmup * factor)``
(Python's round, so 2.5 steps gives 2); the effective batch is
``batch_size * accum * world``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RULES = ("none", "linear", "sqrt", "cap:N")
BY = ("world", "batch")
_CAP = re.compile(r"^cap:([0-9]{1,9}(?:\.[0-9]{1,9})?)\Z")  # ASCII: not ٣


class ScalingRuleError(ValueError):
    """A rule or size that no caller can apply; each side prefixes its own field name."""


@dataclass(frozen=True)
class Rule:
    """A parsed rule: ``kind`` is none, linear, sqrt or cap; ``cap`` is N for cap."""

    kind: str
    cap: float | None = None

    def factor(self, world_size: int, base_world_size: int = 1) -> float:
        """How much lr (and warmup) grow at ``world_size`` ranks."""
        if world_size < 1:
            raise ScalingRuleError(f"{world_size} ranks; allowed: a whole number >= 1")
        if base_world_size < 1:
            raise ScalingRuleError(f"base world size {base_world_size}; allowed: >= 1")
        return self.of_ratio(world_size / base_world_size)

    def of_ratio(self, ratio: float) -> float:
        """The factor for a size ``ratio`` (ranks or samples, against the tuned base)."""
        if self.kind == "none":
            return 1.0
        if self.kind == "linear":
            return ratio
        if self.kind == "sqrt":
            return math.sqrt(ratio)
        assert self.cap is not None  # parse_rule sets it for kind "cap"
        return min(ratio, self.cap)


def parse_rule(text: str) -> Rule:
    """``'none' | 'linear' | 'sqrt' | 'cap:N'`` (N >= 1, may be fractional) -> Rule."""
    if text in ("none", "linear", "sqrt"):
        return Rule(text)
    m = _CAP.match(text)
    if m and float(m.group(1)) >= 1:
        return Rule("cap", float(m.group(1)))
    raise ScalingRuleError(
        f"{text!r} is not a scaling rule; allowed: none, linear, sqrt, cap:N (N >= 1)"
    )


def scale_factor(rule: str, world_size: int, base_world_size: int = 1) -> float:
    """The LR multiplier of ``rule`` for ``world_size`` ranks relative to ``base_world_size``."""
    return parse_rule(rule).factor(world_size, base_world_size)


def batch_ratio(effective: int, base_batch_size: int) -> float:
    """``effective / base_batch_size``: how many times the tuned batch one step now sees."""
    if effective < 1:
        raise ScalingRuleError(f"effective batch {effective}; allowed: a whole number >= 1")
    if base_batch_size < 1:
        raise ScalingRuleError(f"base batch size {base_batch_size}; allowed: a whole number >= 1")
    return effective / base_batch_size


def factor_by(
    rule: str,
    by: str,
    world_size: int,
    *,
    base_world_size: int = 1,
    effective: int = 1,
    base_batch_size: int = 0,
) -> float:
    """The LR multiplier of ``rule`` when the size that grows is ``by`` (world or batch).

    ``effective`` is the effective batch at ``world_size`` ranks (batch x accum x world);
    ``base_batch_size`` is the effective batch the base LR was tuned for.
    """
    if by == "world":
        return scale_factor(rule, world_size, base_world_size)
    if by == "batch":
        if world_size < 1:
            raise ScalingRuleError(f"{world_size} ranks; allowed: a whole number >= 1")
        return parse_rule(rule).of_ratio(batch_ratio(effective, base_batch_size))
    raise ScalingRuleError(f"by {by!r}; allowed: {', '.join(BY)}")


def scaled_lr(lr: float, factor: float) -> float:
    return lr * factor


def scaled_warmup(warmup_steps: int, factor: float) -> int:
    """Warmup grows with the factor so it covers the same number of samples."""
    return int(round(warmup_steps * factor))


def effective_batch(batch_size: int, accum: int, world_size: int) -> int:
    """Samples per optimizer step over all ranks."""
    return batch_size * accum * world_size
