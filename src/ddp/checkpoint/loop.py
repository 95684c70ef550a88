"""The trainer's counters as state objects: :class:`TrainState` (the run's step and
what this run has trained) and :class:`LoopState` (where the loop is in a phase, and
what it trains with).

Each has torch.distributed.checkpoint's ``Stateful`` shape (``state_dict()`` /
``load_state_dict()``), so the :class:`~ddp.checkpoint.manager.Checkpointer` saves
and restores them as a unit instead of copying fields in and out by hand. Their
``state_dict()`` keys are the checkpoint file's own top-level keys (``global_step``,
``phase``, ``epoch``, ``batches_in_epoch``, ``samples_in_epoch``,
``phase_start_step``), unchanged, so every checkpoint written before these classes
existed resumes as it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    """What torch.distributed.checkpoint calls ``Stateful``: state out, state back in."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """The run's counters (torchtitan's ``TrainState``): the global step a checkpoint
    keeps, and two a run keeps for itself (not saved: they describe this run only)."""

    global_step: int = 0
    #: samples this rank trained on in this run (the summary's rate; a resumed run counts
    #: afresh, as its wall time does)
    samples: int = 0
    #: max_steps reached: no more training in this run (a resumed run derives it again)
    finished: bool = False

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.global_step = int(state_dict["global_step"])


@dataclass
class LoopState:
    """Where the loop is and what it trains with: what a checkpoint captures.

    ``state_dict()`` is the position only (phase, epoch, micro-batch, samples of the
    epoch's global order, the phase's first step); the optimizer, schedule and scaler
    are saved and restored by the Checkpointer, which checks them against this run's
    first (and, sharded, writes the optimizer through DCP)."""

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
    accum: int = 1  # micro-batches per optimizer step (a resumed position is whole steps)
    #: the (epoch, micro-batch) a run resumed from the next checkpoint starts at; the
    #: trainer sets it before each save (an evaluation still owed is (epoch, n_batches),
    #: a finished epoch the next one's start). None: :meth:`after_batches`.
    resume_at: tuple[int, int] | None = None

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

    def state_dict(self) -> dict[str, Any]:
        """The position a resumed run starts at (:attr:`resume_at`), as the checkpoint's
        keys: ``samples_in_epoch`` lets any world size resume there, ``batches_in_epoch``
        is this world size's count (what checkpoints before it held)."""
        epoch, batch = self.resume_at if self.resume_at is not None else self.after_batches()
        return {
            "phase": self.phase,
            "epoch": epoch,
            "batches_in_epoch": batch,
            "samples_in_epoch": self.samples_done((epoch, batch)),
            "phase_start_step": self.phase_start,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at the saved position on this run's world size. ``samples_in_epoch``
        must be there: the Checkpointer derives it for a checkpoint written before it
        (:func:`~ddp.checkpoint.manager_resume.samples_in_epoch`)."""
        self.phase = int(state_dict.get("phase", self.phase))
        self.phase_start = int(state_dict.get("phase_start_step", self.phase_start))
        self.epoch = int(state_dict["epoch"])
        self.seek(int(state_dict["samples_in_epoch"]), self.accum)
