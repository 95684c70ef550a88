"""The trainer's counters as state objects (``TrainState``, ``LoopState``, ``BestValue``):
what they save is the checkpoint layout written before they existed, key for key, and a
checkpoint of that layout resumes at the same position, on any world size.

``_old_common`` and ``_old_save`` are the save path as it was written before the state
objects (``Saving._common`` and ``Saving.save``'s plain branch on one rank), frozen here
so the layout they wrote stays a fixed point the new code must read and reproduce."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp import checkpoint as ckpt
from ddp.checkpoint.loop import LoopState, TrainState
from ddp.checkpoint.manager import BestValue, Checkpointer
from ddp.config import TrainConfig
from ddp.dist import Context

BATCH, ACCUM = 4, 2


def _ctx(world: int = 1) -> Context:
    return Context(0, 0, world, world, 0, torch.device("cpu"), "gloo", "none", "127.0.0.1", 0)


def _cfg(ck: Path) -> TrainConfig:
    return TrainConfig.from_dict(
        {"training": {"batch_size": BATCH, "accum": ACCUM}, "checkpoint": {"dir": str(ck)}}
    )


def _parts(world: int = 1, steps: int = 3) -> tuple[torch.nn.Module, LoopState]:
    """A model a few optimizer steps in (moments and a schedule position to restore)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    loop = LoopState(0, 0, 0, 10, 0, opt, sched, None, per_batch=BATCH * world, accum=ACCUM, base=0)
    return model, loop


def _old_common(
    loop: LoopState, global_step: int, at: tuple[int, int], world: int, cfg: TrainConfig
) -> dict[str, Any]:
    """``Saving._common`` before the state objects (frozen)."""
    epoch, batch = at
    return {
        "scheduler": loop.sched.state_dict(),
        "scaler": loop.scaler.state_dict() if loop.scaler is not None else None,
        "phase": loop.phase,
        "epoch": epoch,
        "batches_in_epoch": batch,
        "samples_in_epoch": loop.samples_done(at),  # any world size resumes here
        "global_step": global_step,
        "phase_start_step": loop.phase_start,
        "world_size": world,
        "rank_files": True,
        "config": cfg.to_dict(),
    }


def _old_save(
    cp: Checkpointer, loop: LoopState, model: torch.nn.Module, step: int, at: tuple[int, int]
) -> None:
    """``Saving.save`` before the state objects, one rank, plain checkpoint (frozen)."""
    directory = Path(cp.dir or "")
    ranks = ckpt.staging_path(ckpt.rank_dir(ckpt.step_path(directory, step)))
    own = {"global_step": step, "world_size": cp.ctx.world_size, "rank_rng": ckpt.rng_state()}
    ckpt.write_rank_state(ranks, 0, own)
    state = {
        "model": ckpt.model_state(model),
        "optimizer": loop.opt.state_dict(),
        **_old_common(loop, step, at, cp.ctx.world_size, cp.config),
    }
    staged = ckpt.stage_save(state, directory, step)
    staged.finish(cp.config.checkpoint.keep_last, False, ranks).wait()


# Positions the trainer saves at: mid-epoch, mid-epoch after a resume on another world
# size (base > 0), the epoch's end with its evaluation owed, the next epoch's start.
POSITIONS = [
    # (epoch, batch, base, n_batches, at)
    (0, 4, 0, 10, None),
    (1, 6, 8, 10, None),
    (2, 0, 0, 10, (2, 10)),
    (2, 0, 0, 10, (3, 0)),
    (0, 10, 0, 10, None),  # at max_steps on the epoch's last step: the next epoch's start
]


@pytest.mark.parametrize(("epoch", "batch", "base", "n", "at"), POSITIONS)
def test_the_state_objects_write_the_layout_checkpoints_had(
    tmp_path: Path, epoch: int, batch: int, base: int, n: int, at: tuple[int, int] | None
) -> None:
    """Every key and value of a checkpoint file, rank file included, as before."""
    cp = Checkpointer(_cfg(tmp_path), _ctx(2))
    model, loop = _parts(world=2)
    loop.epoch, loop.batch, loop.base, loop.n_batches, loop.phase_start = epoch, batch, base, n, 3
    loop.phase, loop.resume_at = 1, at
    old_at = at if at is not None else loop.after_batches()
    assert cp._common(loop, TrainState(17)) == _old_common(loop, 17, old_at, 2, cp.config)

    cp = Checkpointer(_cfg(tmp_path / "new"), _ctx(1), background=False)
    cp.save(loop, model, TrainState(17, samples=99, finished=True))
    saved = torch.load(ckpt.step_path(tmp_path / "new", 17), weights_only=True)
    assert set(saved) == {
        *("model", "optimizer", "scheduler", "scaler", "phase", "epoch", "batches_in_epoch"),
        *("samples_in_epoch", "global_step", "phase_start_step", "world_size", "rank_files"),
        *("config", "format"),
    }  # nothing of this run's own (samples, finished) is saved
    own = ckpt.read_rank_state(ckpt.step_path(tmp_path / "new", 17), 0, saved)
    assert set(own) == {"format", "global_step", "world_size", "rank", "rank_rng"}
    assert own["global_step"] == 17


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_checkpoint_of_the_old_layout_resumes_at_its_position(tmp_path: Path, world: int) -> None:
    """Written by the frozen old save path on 2 ranks' worth of position (mid-epoch, not
    a whole step of 3 ranks); read back by the state objects on 1, 2 and 3 ranks: the
    same step, sample position, weights, optimizer moments and schedule."""
    writer = Checkpointer(_cfg(tmp_path), _ctx(1), background=False)
    writer.ctx = dataclasses.replace(writer.ctx, world_size=2)  # a 2-rank run's position
    model, loop = _parts(world=2)
    loop.epoch, loop.batch, loop.phase_start = 1, 6, 2
    _old_save(writer, loop, model, 5, (1, 6))
    writer.close()

    reader = Checkpointer(_cfg(tmp_path), _ctx(world))
    state = reader.load()
    assert state is not None
    train = TrainState()
    train.load_state_dict(state)
    fresh, new_loop = _parts(world=world, steps=0)
    reader.restore_model(state, fresh)
    reader.restore_loop(state, new_loop, 0.01, fresh)
    assert train.global_step == 5
    assert (new_loop.phase, new_loop.epoch, new_loop.phase_start) == (0, 1, 2)
    assert new_loop.samples_done() == 6 * BATCH * 2  # the same global position
    per_step = BATCH * world * ACCUM
    assert new_loop.batch == 48 // per_step * ACCUM and new_loop.batch % ACCUM == 0
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert new_loop.sched.last_epoch == loop.sched.last_epoch == 3
    old_moments = [s["exp_avg"] for s in loop.opt.state_dict()["state"].values()]
    new_moments = [s["exp_avg"] for s in new_loop.opt.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(old_moments, new_moments, strict=True))
    reader.close()


def test_the_loop_position_round_trips_across_world_sizes() -> None:
    """A position saved on 2 ranks and loaded on 3 then saved again is the same sample."""
    _, two = _parts(world=2, steps=0)
    two.epoch, two.batch = 0, 5
    saved = two.state_dict()
    assert saved["samples_in_epoch"] == 5 * BATCH * 2 and saved["batches_in_epoch"] == 5
    _, three = _parts(world=3, steps=0)
    three.n_batches = 10
    three.load_state_dict(saved)
    assert three.samples_done() == saved["samples_in_epoch"] and three.base > 0
    assert three.state_dict()["samples_in_epoch"] == saved["samples_in_epoch"]
    train = TrainState(samples=7, finished=True)
    train.load_state_dict({"global_step": 9})
    assert train == TrainState(9, samples=7, finished=True)  # only the step is restored


@pytest.mark.parametrize(
    ("meta", "value"),
    [
        ({"metric": "eval_loss", "mode": "min", "value": 0.5, "step": 4}, 0.5),  # as written
        ({"metric": "eval_acc", "mode": "min", "value": 0.5, "step": 4}, None),
        ({"metric": "eval_loss", "mode": "max", "value": 0.5, "step": 4}, None),
        ({"metric": "eval_loss", "mode": "min", "value": True, "step": 4}, None),
        ({"metric": "eval_loss", "mode": "min", "value": float("nan"), "step": 4}, None),
        ({"metric": "eval_loss", "mode": "min", "value": "0.1"}, None),
        ({}, None),
    ],
)
def test_the_best_value_reads_best_json_as_it_was_written(meta: dict, value: object) -> None:
    best = BestValue("eval_loss", "min")
    best.load_state_dict(json.loads(json.dumps(meta)))
    assert best.value == value
    if value is not None:
        assert best.state_dict() == meta  # the same file again
        assert best.improves(0.4) and not best.improves(0.6) and not best.improves(float("nan"))
    else:
        assert best.improves(1e9)  # nothing comparable kept: the next one is the best
