"""The Checkpointer: one object that owns a run's checkpoints.

It owns the state keys (the trainer never builds a checkpoint dict), the directory lock,
the background save and its errors, keep-last pruning, the resume lookup, restoring
every piece of state, the checks that a checkpoint fits this run, and the final export.
The file format itself (atomic writes, digests, ``latest``) is :mod:`ddp.checkpoint`.
The class is written in parts, by path: :mod:`ddp.checkpoint.manager_save` (save, export),
:mod:`ddp.checkpoint.manager_resume` (load, restore, the checks that a checkpoint fits this
run), :mod:`ddp.checkpoint.manager_best` (``checkpoint.best``), on
:mod:`ddp.checkpoint.manager_base` (directory lock, pending save, the ranks' agreement);
the counters it saves as state objects (``TrainState``, ``LoopState``) are
:mod:`ddp.checkpoint.loop`.
Modelled on torchtitan's ``CheckpointManager``; every method that touches other ranks
says so.
"""

from __future__ import annotations

from ddp.checkpoint.loop import LoopState, Stateful, TrainState  # noqa: F401
from ddp.checkpoint.manager_best import Best, BestValue, best_key  # noqa: F401
from ddp.checkpoint.manager_resume import (  # noqa: F401
    Resume,
    apply_new_hyperparameters,
    check_optimizer,
    check_resumable,
    derive_rng,
    load_model,
    samples_in_epoch,
)
from ddp.checkpoint.manager_save import Saving, diverged, finite  # noqa: F401


class Checkpointer(Saving, Resume, Best):
    """Saves and restores one run's state in ``config.checkpoint.dir`` (None: off)."""
