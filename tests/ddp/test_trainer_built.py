"""The Trainer built whole: one ``Run`` per ``fit()`` instead of ``None`` collaborators,
one ``Preemption`` owning the signal, vote and requeue flags, and no ``# type: ignore``
left to hide a half-built attribute."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from ddp.config import TrainConfig
from ddp.preemption import Preemption
from ddp.trainer import Trainer

SRC = Path(__file__).resolve().parents[2] / "src" / "ddp"


def _config(**preemption: object) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "training": {"epochs": 1, "batch_size": 4},
            "checkpoint": {"dir": None},
            "logging": {"progress": "off"},
            "preemption": preemption,
        }
    )


def test_the_trainer_hides_no_type_errors():
    for name in ("trainer.py", "trainer_loop.py"):
        text = (SRC / name).read_text(encoding="utf-8")
        assert "type: ignore" not in text, name


def test_collaborators_before_fit_are_an_error_not_none():
    """Before fit() there is no run: asking for its checkpointer says so instead of
    handing back a None that fails later."""
    data = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    trainer = Trainer(torch.nn.Linear(2, 1), data, _config())
    assert not trainer.preempt_requested
    for name in ("checkpointer", "loggers", "ctx"):
        with pytest.raises(RuntimeError, match="once fit"):
            getattr(trainer, name)


def test_preemption_owns_the_signal_and_the_vote():
    """The handler only sets the flag; the vote, asked at step boundaries, turns it into
    a stop at its cadence; restore() puts the previous handler back."""
    before = signal.getsignal(signal.SIGUSR1)
    cfg = _config(signals=["SIGUSR1"], check_every_n_steps=2, check_interval_s=0)
    pre = Preemption(cfg.preemption, rank=0, world_size=1)
    assert pre.vote.every == 0  # not installed: it never votes
    pre.install()
    try:
        assert pre.vote.every == 2 and not pre.requested and not pre.step(2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert pre.requested and pre.signal == signal.SIGUSR1
        assert not pre.step(3)  # between votes
        assert pre.step(4)
        assert pre.settle()  # an epoch's end acts on it too
    finally:
        pre.restore()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_without_signals_or_timed_saves_the_vote_stays_off():
    cfg = _config(signals=[])
    pre = Preemption(cfg.preemption, rank=0, world_size=1)
    pre.install()
    try:
        assert pre.vote.every == 0 and not pre.step(1) and not pre.settle()
    finally:
        pre.restore()
    timed = Preemption(cfg.preemption, rank=0, world_size=1, every_s=60.0)
    timed.install()
    try:
        assert timed.vote.every == 1  # checkpoint.every_s rides on the vote
    finally:
        timed.restore()


def test_the_counters_are_one_state_object_the_checkpointer_saves():
    """The global step lives in the Trainer's TrainState (read and written through
    ``global_step``); its state_dict is what a checkpoint keeps of it, and this run's own
    counts (samples, finished) are not part of it."""
    from ddp.checkpoint.loop import TrainState

    data = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    trainer = Trainer(torch.nn.Linear(2, 1), data, _config())
    assert isinstance(trainer.train_state, TrainState) and trainer.global_step == 0
    trainer.global_step = 5
    trainer.train_state.samples = 40
    assert trainer.train_state.state_dict() == {"global_step": 5}
    trainer.train_state.load_state_dict({"global_step": 9, "epoch": 2})
    assert trainer.global_step == 9 and trainer.train_state.samples == 40
