"""``checkpoint.every_s``: time-based checkpoints agreed through the preemption vote (issue 30.3).

Real 2-rank Gloo runs of the Trainer (``_train_worker``). No test waits on the wall
clock: the Trainer's clock is injected (``clock_per_step``: the clock reads the global
step times a constant), or the assertion holds for any timing (a tiny ``every_s`` makes
rank 0 vote a save at every vote).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ddp.config import TrainConfig
from ddp.errors import ConfigError
from tests.ddp import _launch

WORKER = "tests/ddp/_train_worker.py"


def _run(tmp_path: Path, checkpoint: dict, n: int = 64, epochs: int = 2, **spec) -> dict:
    """Train on 2 ranks (batch 4: n / 8 steps per epoch, a vote every step); the steps
    saved, each with the rank files present, by step."""
    ckpt = tmp_path / "ckpt"
    cfg = {
        "training": {"batch_size": 4, "epochs": epochs},
        "optim": {"name": "sgd", "lr": 0.01},
        "checkpoint": {"dir": str(ckpt), "keep_last": 1000, **checkpoint},
        "logging": {"every_n_steps": 1000, "progress": "off"},
        "preemption": {"check_interval_s": 0},  # a vote every step: no pacing by step time
    }
    results = _launch.run(
        [WORKER, json.dumps({"config": cfg, "n": n, **spec})], world=2, timeout=120
    )
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}: {out[-2000:]}\n{err[-3000:]}"
    saved: dict[int, list[str]] = {}
    for d in ckpt.glob("step_*.ranks"):
        step = int(re.fullmatch(r"step_(\d+)\.ranks", d.name).group(1))  # type: ignore[union-attr]
        saved[step] = sorted(p.name for p in d.iterdir())
    return dict(sorted(saved.items()))


BOTH = ["rank_000000.pt", "rank_000001.pt"]


def test_off_gives_only_epoch_end_checkpoints(tmp_path):
    saved = _run(tmp_path, {"every_s": 0})
    assert list(saved) == [8, 16]
    assert all(files == BOTH for files in saved.values()), saved


def test_a_tiny_interval_saves_at_every_vote_on_both_ranks(tmp_path):
    """Rank 0 votes a save at every vote (any clock passes 1 us); the vote started at step s
    is read at s + 1 on every rank, which saves there. The vote started at that same step
    was decided before the checkpoint, so its save is dropped: a checkpoint every other
    step, each holding both ranks' files (a save is collective: ranks saving at different
    steps would hang or fail the run)."""
    saved = _run(tmp_path, {"every_s": 1e-6})
    assert list(saved) == [2, 4, 6, 8, 10, 12, 14, 16], saved
    assert all(files == BOTH for files in saved.values()), saved


def test_rank0s_clock_decides_the_interval(tmp_path):
    """Rank 0's clock advances 0.5 s per step, rank 1's 100 s (ignored): with every_s 2,
    rank 0 votes a save 4 steps after the last checkpoint, read one step later: a
    checkpoint every 5 steps, and the epoch's end."""
    saved = _run(tmp_path, {"every_s": 2}, n=128, epochs=1, clock_per_step=[0.5, 100.0])
    assert list(saved) == [5, 10, 15, 16], saved
    assert all(files == BOTH for files in saved.values()), saved


def test_every_n_steps_and_every_s_together_count_from_the_latest_checkpoint(tmp_path):
    """A step-count checkpoint at 4 resets the clock: the next timed one is at 4 + 5."""
    saved = _run(tmp_path, {"every_s": 2, "every_n_steps": 4}, n=128, epochs=1, clock_per_step=0.5)
    assert list(saved) == [4, 8, 12, 16], saved  # every_n_steps keeps the clock from firing


@pytest.mark.parametrize("value", [-1, "nan", "inf", "soon", True, 1e12])
def test_bad_every_s_is_one_line(value):
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_dict({"checkpoint": {"every_s": value}})
    msg = str(exc.value)
    assert "checkpoint.every_s" in msg and "\n" not in msg, msg


def test_every_s_default_is_off():
    assert TrainConfig.from_dict({}).checkpoint.every_s == 0
    assert TrainConfig.from_dict({"checkpoint": {"every_s": 900}}).checkpoint.every_s == 900


def test_the_vote_levels_in_one_process():
    """The vote's verdicts without ranks: rank 0 (``decides``) saves once ``save_every_s``
    of its clock have passed since the last checkpoint; another rank's clock never asks; a
    stop outranks a save."""
    from ddp.preemption import Vote

    now = [0.0]
    vote = Vote(1, world_size=1, save_every_s=2.0, clock=lambda: now[0])
    now[0] = 1.9
    assert not vote.step(1, flagged=False) and not vote.take_save()
    now[0] = 2.0
    assert not vote.step(2, flagged=False) and vote.take_save()
    assert not vote.take_save()  # once
    vote.saved()
    now[0] = 3.0
    assert not vote.step(3, flagged=False) and not vote.take_save()  # 1 s since the save
    now[0] = 10.0
    assert vote.step(4, flagged=True) and not vote.take_save()  # the stop saves anyway
    other = Vote(1, world_size=1, save_every_s=2.0, decides=False, clock=lambda: now[0])
    now[0] = 100.0
    assert not other.step(1, flagged=False) and not other.take_save()
