"""Resume at another world size: the epoch's global order goes on from the saved sample
count, on 1 or 3 ranks after 2, with no sample skipped and none repeated beyond the
sampler's documented end-of-epoch padding (at most world - 1). Real Gloo ranks."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp import parts
from ddp.checkpoint.manager import LoopState
from tests.ddp import _launch

WORKER = "tests/ddp/_index_worker.py"
N, BATCH, SEED = 50, 4, 5


def _spec(tmp: Path, ckpt: Path, logs: Path, **training: object) -> dict:
    logs.mkdir(parents=True, exist_ok=True)
    return {
        "n": N,
        "log_dir": str(logs),
        "config": {
            "training": {
                "batch_size": BATCH,
                "epochs": 2,
                "shuffle": True,
                "seed": SEED,
                **training,
            },
            "optim": {"name": "sgd", "lr": 0.01},
            "checkpoint": {"dir": str(ckpt), "save_final": False},
            "logging": {"every_n_steps": 2, "progress": "plain"},
        },
    }


def _run(spec: dict, world: int) -> list[tuple[int, str, str]]:
    results = _launch.run([WORKER, json.dumps(spec)], world=world, timeout=120)
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{out[-2000:]}\n{err[-3000:]}"
    return results


def _seen(logs: Path) -> dict[int, list[int]]:
    """Indices trained on per epoch, over every rank's log in ``logs``."""
    out: dict[int, list[int]] = {}
    for f in logs.glob("*.txt"):
        for line in f.read_text().splitlines():
            epoch, *ids = map(int, line.split())
            out.setdefault(epoch, []).extend(ids)
    return out


def _head(epoch: int, k: int) -> set[int]:
    """The first k samples of the epoch's global order: the only ones padding repeats."""
    s = parts.GlobalOrderSampler(N, 1, 0, BATCH, True, SEED)
    s.set_epoch(epoch)
    return set(s.order(np.arange(k)).tolist())


def _check_epoch(ids: list[int], epoch: int, world_at_end: int) -> None:
    counts = Counter(ids)
    assert sorted(counts) == list(range(N)), f"epoch {epoch}: skipped {set(range(N)) - set(counts)}"
    extra = len(ids) - N
    assert 0 <= extra <= world_at_end - 1, (epoch, extra)
    repeated = {i for i, c in counts.items() if c > 1}
    assert all(counts[i] == 2 for i in repeated)
    assert repeated <= _head(epoch, world_at_end - 1), (epoch, repeated)


@pytest.fixture(scope="module")
def checkpoint_of_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """2 ranks stop at max_steps=2, mid-epoch 0: 16 of 50 samples, not a multiple of 3 x 4."""
    tmp = tmp_path_factory.mktemp("two")
    _run(_spec(tmp, tmp / "ck", tmp / "logs", max_steps=2), world=2)
    state = torch.load(tmp / "ck" / "step_000000002.pt", weights_only=False)
    assert (state["world_size"], state["epoch"], state["samples_in_epoch"]) == (2, 0, 16)
    return tmp / "ck", tmp / "logs"


@pytest.mark.parametrize(("world", "workers"), [(1, 2), (3, 1)])
def test_resume_on_another_world_size_sees_every_sample_once(
    checkpoint_of_two_ranks: tuple[Path, Path], tmp_path: Path, world: int, workers: int
) -> None:
    ckpt, logs = checkpoint_of_two_ranks
    shutil.copytree(ckpt, tmp_path / "ck")
    before = _seen(logs)
    assert list(before) == [0] and len(before[0]) == 16 and len(set(before[0])) == 16
    spec = _spec(tmp_path, tmp_path / "ck", tmp_path / "logs")
    spec["config"]["data"] = {"num_workers": workers}
    results = _run(spec, world=world)
    after = _seen(tmp_path / "logs")
    _check_epoch(before[0] + after[0], 0, world)
    _check_epoch(after[1], 1, world)
    out = "".join(o + e for _, o, e in results)
    assert out.count("RNG streams derived from") == 1  # said once, by rank 0


def test_a_preemption_in_the_evaluation_after_a_world_change_trains_nothing_again(
    checkpoint_of_two_ranks: tuple[Path, Path], tmp_path: Path
) -> None:
    """3 ranks resume the 2 ranks' epoch 0 at 16 samples (a 3-rank micro-batch is 12: 4
    samples are the position's remainder), finish it, and are preempted in its
    evaluation: the checkpoint says the epoch is done, so the resumed run evaluates and
    goes on with epoch 1 without training any sample of epoch 0 a second time."""
    ckpt, logs = checkpoint_of_two_ranks
    shutil.copytree(ckpt, tmp_path / "ck")
    spec = _spec(tmp_path, tmp_path / "ck", tmp_path / "mid")
    spec["config"]["preemption"] = {"signals": ["SIGUSR1"]}
    spec.update(eval_n=12, signal_in_eval=True)
    results = _launch.run([WORKER, json.dumps(spec)], world=3, timeout=120)
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 75, f"rank {rank} exit {rc}\n{out[-2000:]}\n{err[-3000:]}"
    state = torch.load(ckpt_path := ckpt_latest(tmp_path / "ck"), weights_only=False)
    assert state["epoch"] == 0 and state["samples_in_epoch"] >= N, (ckpt_path, state)
    spec = _spec(tmp_path, tmp_path / "ck", tmp_path / "end")
    spec.update(eval_n=12)
    _run(spec, world=3)
    before, mid, end = _seen(logs), _seen(tmp_path / "mid"), _seen(tmp_path / "end")
    _check_epoch(before[0] + mid[0], 0, 3)
    assert 0 not in end, end.get(0)  # epoch 0 was done: nothing of it trained again
    _check_epoch(end[1], 1, 3)


def ckpt_latest(directory: Path) -> Path:
    from ddp import checkpoint as ckpt

    latest = ckpt.find_latest(directory)
    assert latest is not None
    return latest


def test_old_checkpoint_without_sample_count_resumes_at_the_same_position() -> None:
    """A checkpoint written before samples_in_epoch: batches_in_epoch of its world size."""
    from ddp.checkpoint.manager import Checkpointer
    from ddp.config import TrainConfig
    from ddp.dist import Context

    cfg = TrainConfig.from_dict({"training": {"batch_size": 4, "accum": 2}})
    for world, saved_world, batches, want in [
        (2, 2, 6, (6, 0)),
        (3, 2, 6, (4, 0)),
        (1, 2, 4, (8, 0)),
        (3, 2, 5, (2, 16)),
    ]:
        ctx = Context(
            rank=0,
            local_rank=0,
            world_size=world,
            local_world_size=world,
            node_rank=0,
            device=torch.device("cpu"),
            backend="gloo",
            launcher="test",
            master_addr="127.0.0.1",
            master_port=1,
        )
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        loop = LoopState(0, 0, 0, 10, 0, opt, sched, None, per_batch=4 * world, accum=2)
        state = {
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "epoch": 1,
            "batches_in_epoch": batches,
            "world_size": saved_world,
        }
        Checkpointer(cfg, ctx).restore_loop(state, loop, 0.1, model)
        assert loop.epoch == 1
        assert loop.samples_done() == batches * saved_world * 4  # the same global position
        assert (loop.batch, loop.base) == want


@pytest.mark.parametrize("n", [1, 2, 7, 50, 1000, 4099])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_sampler_positions_partition_the_epoch_from_any_start(n: int, world: int) -> None:
    order = parts.GlobalOrderSampler(n, 1, 0, 3, True, 1)
    order.set_epoch(2)
    full = order.order(np.arange(n)).tolist()
    assert sorted(full) == list(range(n))  # a permutation
    for start in sorted({0, 1, n // 3, n - 1, n}):
        got: list[int] = []
        for rank in range(world):
            s = parts.GlobalOrderSampler(n, world, rank, 3, True, 1)
            s.set_epoch(2)
            s.start = start
            mine = list(s)
            assert len(mine) == len(s) and -(-len(mine) // 3) == s.batches_left()
            got += mine
        rest = Counter(got)
        assert set(rest) >= set(full[start:]) and sum(rest.values()) - (n - start) < world


def test_resume_with_accumulation_on_three_ranks(tmp_path: Path) -> None:
    """accum 2: the saved position (16 samples) is no whole step of 3 ranks (24): the
    resumed run starts its micro-batch count at 0 with 16 samples behind it."""
    _run(_spec(tmp_path, tmp_path / "ck", tmp_path / "a", accum=2, max_steps=1), world=2)
    state = torch.load(tmp_path / "ck" / "step_000000001.pt", weights_only=False)
    assert state["samples_in_epoch"] == 16
    _run(_spec(tmp_path, tmp_path / "ck", tmp_path / "b", accum=2), world=3)
    before, after = _seen(tmp_path / "a"), _seen(tmp_path / "b")
    _check_epoch(before[0] + after[0], 0, 3)
    _check_epoch(after[1], 1, 3)


def test_derived_rng_streams_are_deterministic_and_differ_by_rank() -> None:
    from ddp.checkpoint.manager import derive_rng

    draws = []
    for rank in (0, 1, 0):
        derive_rng(7, 100, rank)
        draws.append(torch.rand(3).tolist())
    assert draws[0] == draws[2] and draws[0] != draws[1]
