"""``LoopState``: where the training loop is and what it trains with.

What a checkpoint captures of the loop (phase, epoch, micro-batch, the data position in
samples, optimizer, schedule, scaler); the :class:`~ddp.checkpoint.manager.Checkpointer`
saves it and restores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoopState:
    """Where the loop is and what it trains with: what a checkpoint captures."""

    phase: int
    epoch: int
    batch: int  # micro-batches done in this epoch
    n_batches: int  # micro-batches per epoch on this rank
    phase_start: int  # global step at which this phase began
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any  # torch.amp.GradScaler for fp16, else None
    per_batch: int = 1  # samples one micro-batch of the whole job takes (batch x world)
    base: int = 0  # samples of the epoch consumed before micro-batch 0 of this run's count

    def samples_done(self, at: tuple[int, int] | None = None) -> int:
        """Samples consumed in the epoch's global order (all ranks together) at micro-batch
        ``at`` = (epoch, batch), default now: the position a checkpoint records."""
        epoch, batch = at if at is not None else (self.epoch, self.batch)
        return (self.base if epoch == self.epoch else 0) + batch * self.per_batch

    def seek(self, samples: int, accum: int) -> None:
        """Continue at ``samples`` into the epoch, on this run's world size: whole
        optimizer steps of this world size as micro-batches, the rest as ``base``."""
        self.batch = samples // (self.per_batch * accum) * accum
        self.base = samples - self.batch * self.per_batch

    def after_batches(self) -> tuple[int, int]:
        """The position after the batches done so far: a finished epoch is the next
        one's start (an evaluation still owed is saved as (epoch, n_batches) instead)."""
        if self.batch >= self.n_batches:
            return self.epoch + 1, 0
        return self.epoch, self.batch
