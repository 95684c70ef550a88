"""FSDP2 through ddp.wrap and the Trainer (issue 16): real Gloo ranks on the CPU.

fsdp must train like ddp (fp32 round-off), resume bit-exactly at the same world size,
reshard its checkpoints to other world sizes, survive kill -9 during a sharded save,
and export a plain final/model.pt.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp.checkpoint.loop import TrainState
from tests.ddp import _launch
from tests.ddp._train_worker import make_model
from tests.ddp.test_trainer_dist import _wait_for

WORKER = "tests/ddp/_train_worker.py"


def _cfg(ck: Path, strategy: str = "fsdp", **training: object) -> dict:
    return {
        "training": {
            "batch_size": 2,
            "accum": 2,
            "epochs": 1,
            "shuffle": True,
            "seed": 5,
            **training,
        },
        "optim": {"name": "adamw", "lr": 0.01, "grad_clip": 0.5},
        "ddp": {"strategy": strategy, "fsdp_blocks": ["0", "3"]},
        "checkpoint": {"dir": str(ck)},
        "logging": {"every_n_steps": 5, "progress": "plain"},
        "preemption": {"check_interval_s": 0},
    }


def _ok(results: list[tuple[int, str, str]]) -> None:
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{out[-2000:]}\n{err[-3000:]}"


def _final(ck: Path) -> dict[str, torch.Tensor]:
    return torch.load(ck / "final" / "model.pt", weights_only=True)


def _run(spec: dict, world: int, timeout: float = 120) -> list[tuple[int, str, str]]:
    return _launch.run([WORKER, json.dumps(spec)], world=world, timeout=timeout)


def test_fsdp_trains_like_ddp_and_exports_a_plain_state_dict(tmp_path: Path) -> None:
    """50 steps of AdamW with clipping and accumulation: fsdp == ddp to fp32 round-off."""
    for strategy in ("ddp", "fsdp"):
        spec = {"config": _cfg(tmp_path / strategy, strategy, max_steps=50), "n": 400}
        _ok(_run(spec, world=2))
    a, b = _final(tmp_path / "ddp"), _final(tmp_path / "fsdp")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), (k, (a[k] - b[k]).abs().max())
    model = make_model()
    model.load_state_dict(b)  # the bare model class, no ddp, no DTensor
    sharded = sorted(p.name for p in (tmp_path / "fsdp").iterdir() if p.name.startswith("step_"))
    assert sharded and all((tmp_path / "fsdp" / n / "meta.pt").is_file() for n in sharded)


def test_fsdp_evaluation_is_exact_with_uneven_shards(tmp_path: Path) -> None:
    """9 eval samples on 2 ranks (5 and 4, so 3 and 2 batches): ranks go in lockstep
    under FSDP (a padded batch of weight 0) and the result equals DDP's."""
    got = {}
    for strategy in ("ddp", "fsdp"):
        spec = {
            "config": _cfg(tmp_path / strategy, strategy, max_steps=6),
            "n": 64,
            "eval_n": 9,
            "summary": str(tmp_path / f"{strategy}.json"),
        }
        _ok(_run(spec, world=2))
        got[strategy] = json.loads((tmp_path / f"{strategy}.json").read_text())["eval_loss"]
    assert got["fsdp"] == pytest.approx(got["ddp"], rel=1e-5)


def test_fsdp_resume_after_signal_is_bit_exact(tmp_path: Path) -> None:
    full = {"config": _cfg(tmp_path / "full", epochs=2), "n": 64}
    _ok(_run(full, world=2))
    ready = tmp_path / "ready"
    ready.mkdir()
    part = {
        "config": _cfg(tmp_path / "part", epochs=2),
        "n": 64,
        "wait_signal_step": 5,
        "ready_dir": str(ready),
    }
    procs = _launch.start([WORKER, json.dumps(part)], world=2)
    pids = [ready / "0.pid", ready / "1.pid"]
    _wait_for(pids, procs, timeout=60)
    for p in pids:
        os.kill(int(p.read_text()), signal.SIGTERM)
    results = _launch.finish(procs, timeout=60)
    assert [r[0] for r in results] == [75, 75], [r[2][-2000:] for r in results]
    assert (tmp_path / "part" / "latest").read_text().startswith("step_")
    part.pop("wait_signal_step")
    _ok(_run(part, world=2))
    a, b = _final(tmp_path / "full"), _final(tmp_path / "part")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 2-rank run to step 10 (its checkpoint folder and rank 0's output), made once for
    the reshard tests, which each resume a copy of it."""
    ck = tmp_path_factory.mktemp("two_rank") / "ck"
    first = _run({"config": _cfg(ck, max_steps=10), "n": 256}, world=2)
    _ok(first)
    return ck, first[0][1]


@pytest.mark.parametrize("world", [1, 4])
def test_a_two_rank_checkpoint_reshards_to_other_world_sizes(
    tmp_path: Path, world: int, two_rank_run: tuple[Path, str]
) -> None:
    """The weights a 1- or 4-rank run resumes with are exactly the 2-rank run's, and its
    training goes on from there (the loss keeps the level it had reached)."""
    ck = tmp_path / "ck"
    shutil.copytree(two_rank_run[0], ck)
    first_out = two_rank_run[1]
    assert "step_000000010 (2 shards)" in first_out
    assert "(written in the background)" in first_out  # the default: DCP's async_save
    saved = _final(ck)
    # Resumed with nothing left to do: the export is what was loaded, resharded.
    _ok(_run({"config": _cfg(ck, max_steps=10), "n": 256}, world=world))
    again = _final(ck)
    assert all(torch.equal(saved[k], again[k]) for k in saved)
    out = _run({"config": _cfg(ck, max_steps=20), "n": 256}, world=world)
    _ok(out)
    log = out[0][1]
    assert "resuming from" in log and "step_000000010" in log
    losses = [
        float(line.split("loss=")[1].split()[0])
        for line in log.splitlines()
        if line.startswith("step ") and "loss=" in line
    ]
    before = [
        float(line.split("loss=")[1].split()[0])
        for line in first_out.splitlines()
        if line.startswith("step ") and "loss=" in line
    ]
    assert losses and before
    assert losses[0] < before[0], (before, losses)  # not back at the untrained start


def test_kill_9_during_sharded_saves_then_resume_matches(tmp_path: Path) -> None:
    """Three kill -9s of both ranks at random moments (a sharded save every step), then a
    resume to the end: the same weights as a run never interrupted."""
    from ddp import checkpoint as ckpt

    full = {"config": _cfg(tmp_path / "full", max_steps=40), "n": 400}
    full["config"]["checkpoint"]["every_n_steps"] = 1
    _ok(_run(full, world=2))
    part = json.loads(json.dumps(full).replace(str(tmp_path / "full"), str(tmp_path / "part")))
    rng = random.Random(16)
    latest = tmp_path / "part" / "latest"
    steps_seen = []
    for _ in range(3):
        before = latest.read_text() if latest.exists() else ""
        procs = _launch.start([WORKER, json.dumps(part)], world=2)
        deadline = time.monotonic() + 60
        while (not latest.exists() or latest.read_text() == before) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a rank ended before it was killed"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))  # into the following steps' saves
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)
        steps_seen.append(latest.read_text().strip())
        (tmp_path / "part" / ckpt.LOCK).unlink(missing_ok=True)  # its owner is gone for sure
    assert len(set(steps_seen)) == 3, steps_seen  # every run got further before its kill
    _ok(_run(part, world=2))
    a, b = _final(tmp_path / "full"), _final(tmp_path / "part")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_shard_write_on_one_rank_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    """Rank 1's background shard write fails (ENOSPC): both ranks stop (exit 2, no hang)
    at the next save with the same line naming rank 1; `latest` never names it."""
    spec = {"config": _cfg(tmp_path / "ck", max_steps=8), "n": 256, "fail_write_rank": 1}
    spec["config"]["checkpoint"]["every_n_steps"] = 2
    results = _run(spec, world=2, timeout=120)
    assert [rc for rc, _, _ in results] == [2, 2], [r[2][-2000:] for r in results]
    want = (
        "writing .step_000000002.tmp (rank 1) failed: No space left on device; the "
        "earlier checkpoints are kept"
    )
    for rank, (_, _, err) in enumerate(results):
        lines = [line for line in err.splitlines() if "ddp: error:" in line]
        assert len(lines) == 1 and want in lines[0], err[-3000:]
        assert lines[0].startswith(f"ddp: error: rank {rank} failed: checkpoint.dir"), lines
    ck = tmp_path / "ck"
    assert not (ck / "latest").exists() and not list(ck.glob("*step_*")), list(ck.iterdir())


# ---- units --------------------------------------------------------------------------------


def _one_rank_checkpointer(ck: Path, background: bool = True):
    """A Checkpointer for strategy fsdp on one rank (no process group), its loop and model."""
    from ddp.checkpoint.manager import Checkpointer, LoopState
    from ddp.config import TrainConfig
    from ddp.dist import Context

    cfg = TrainConfig.from_dict({"ddp": {"strategy": "fsdp"}, "checkpoint": {"dir": str(ck)}})
    ctx = Context(0, 0, 1, 1, 0, torch.device("cpu"), "gloo", "none", "127.0.0.1", 0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loop = LoopState(0, 0, 3, 10, 0, opt, sched, None)
    return Checkpointer(cfg, ctx, background), loop, model


def _hold_shard_writes(monkeypatch: pytest.MonkeyPatch):
    """DCP's writer waits for the returned event before it writes (entered: it started)."""
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    gate, entered = threading.Event(), threading.Event()
    original = FileSystemWriter.write_data

    def held(self, plan, planner):
        entered.set()
        assert gate.wait(30), "the test never released the write"
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    return gate, entered


def test_sharded_save_returns_before_its_shards_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async path is taken: save() returns while the write is held, nothing is visible
    until the finalize, and the checkpoint holds the weights of the moment of the call."""
    from ddp import checkpoint as ckpt
    from ddp.checkpoint import sharded

    gate, entered = _hold_shard_writes(monkeypatch)
    cp, loop, model = _one_rank_checkpointer(tmp_path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    cp.save(loop, model, TrainState(3))  # a synchronous save would block here until the timeout
    assert entered.wait(30)
    assert (tmp_path / ".step_000000003.tmp").is_dir()
    assert not (tmp_path / "step_000000003").exists() and not (tmp_path / "latest").exists()
    assert ckpt.load_latest(tmp_path) is None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the loop goes on training while the shards are written
    gate.set()
    cp.wait()
    path, state = ckpt.load_latest(tmp_path)  # type: ignore[misc]
    assert path.name == "step_000000003" and state["global_step"] == 3
    assert (tmp_path / "latest").read_text().strip() == "step_000000003"
    assert not (tmp_path / ".step_000000003.tmp").exists()
    fresh = make_model()
    sharded.load_model(path, fresh)
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())


def test_synchronous_sharded_save_is_complete_on_return(tmp_path: Path) -> None:
    cp, loop, model = _one_rank_checkpointer(tmp_path, background=False)
    cp.save(loop, model, TrainState(3))
    assert (tmp_path / "latest").read_text().strip() == "step_000000003"
    assert (tmp_path / "step_000000003" / "meta.pt").is_file()


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_shard_write_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    """The write fails (in DCP's thread, in the background): wait() (the next save, the
    export, a preemption exit) raises one ConfigError line, as save() itself does when
    synchronous; the staging directory is removed and `latest` stays."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from ddp.errors import ConfigError

    cp, loop, model = _one_rank_checkpointer(tmp_path, background)
    cp.save(loop, model, TrainState(2))
    cp.wait()

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    line = (
        r"writing \.step_000000004\.tmp \(rank 0\) failed: No space left on device; "
        "the earlier checkpoints are kept$"
    )
    if background:
        cp.save(loop, model, TrainState(4))  # returns: the failure is in the background
    with pytest.raises(ConfigError, match=line):
        cp.wait() if background else cp.save(loop, model, TrainState(4))
    cp.wait()  # reported once
    assert (tmp_path / "latest").read_text().strip() == "step_000000002"
    assert not (tmp_path / ".step_000000004.tmp").exists()


def test_resume_ignores_a_staging_directory_left_by_a_kill(tmp_path: Path) -> None:
    """A kill -9 after every shard (even the meta file) was written but before the rename
    leaves `.step_N.tmp`: never a checkpoint to the lookup, removed by the next save."""
    import shutil

    from ddp import checkpoint as ckpt

    cp, loop, model = _one_rank_checkpointer(tmp_path)
    cp.save(loop, model, TrainState(3))
    cp.wait()
    stale = tmp_path / ".step_000000005.tmp"
    shutil.copytree(tmp_path / "step_000000003", stale)
    for pointer in ("step_000000003", ".step_000000005.tmp", "../step_000000003"):
        (tmp_path / "latest").write_text(pointer + "\n")
        path, _ = ckpt.load_latest(tmp_path)  # type: ignore[misc]
        assert path.name == "step_000000003", pointer
    (tmp_path / "latest").unlink()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000000003"]
    assert ckpt.load_latest(tmp_path)[0].name == "step_000000003"  # type: ignore[index]
    cp.save(loop, model, TrainState(7))
    cp.wait()
    assert not stale.exists()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000000003", "step_000000007"]


def test_find_blocks():
    from ddp.fsdp import find_blocks

    stack = nn.Sequential(
        nn.Embedding(10, 8),
        nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), num_layers=2),
    )
    layers = find_blocks(stack)
    assert len(layers) == 2 and all(isinstance(m, nn.TransformerEncoderLayer) for m in layers)
    mlp = make_model()
    assert find_blocks(mlp, ["0", "3"]) == [mlp[0], mlp[3]]
    assert find_blocks(mlp, ["Linear"]) == [mlp[0], mlp[3]]
    assert find_blocks(mlp, nn.Linear) == [mlp[0], mlp[3]]
    from ddp.errors import ConfigError

    with pytest.raises(ConfigError, match="neither a module nor a module class"):
        find_blocks(mlp, ["layers.9"])


def test_strategy_is_checked():
    from ddp.config import TrainConfig
    from ddp.errors import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'fsdp'"):
        TrainConfig.from_dict({"ddp": {"strategy": "fsdpp"}})


def test_crafted_dcp_metadata_is_refused():
    """DCP unpickles its .metadata: ours builds only DCP's own classes."""
    from ddp.checkpoint.sharded import _MetadataUnpickler

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))

    import io

    with pytest.raises(pickle.UnpicklingError, match="refused global"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()


@pytest.mark.parametrize("recipe", ["uniref50", "dpo"])
def test_recipes_run_with_fsdp(tmp_path: Path, recipe: str) -> None:
    """The seed recipes unchanged, `--set ddp.strategy=fsdp` (dpo: the policy is sharded,
    its frozen reference model stays a local copy)."""
    config = "configs/uniref50-tiny.yaml" if recipe == "uniref50" else f"configs/{recipe}.yaml"
    args = [
        "-m",
        "ddp",
        recipe,
        "--config",
        config,
        "--set",
        "ddp.strategy=fsdp",
        "training.max_steps=3",
        f"checkpoint.dir={tmp_path}",
        "logging.progress=plain",
    ]
    results = _launch.run(args, world=2, timeout=180)
    _ok(results)
    assert "done: steps=3" in results[0][1]
    assert (tmp_path / "step_000000003" / "meta.pt").is_file()
    state = torch.load(tmp_path / "final" / "model.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) and type(v) is torch.Tensor for v in state.values())


@pytest.fixture(scope="module")
def full_and_part(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two 2-rank runs of the same data, made once for the tests below: ``full`` to step
    20 and ``part`` stopped at step 10 (each test resumes a copy of ``part``)."""
    root = tmp_path_factory.mktemp("full_and_part")
    for name, steps in (("full", 20), ("part", 10)):
        _ok(_run({"config": _cfg(root / name, max_steps=steps), "n": 160}, world=2))
    return root


@pytest.mark.parametrize("world, batch", [(1, 4), (4, 1)])
def test_resume_on_other_ranks_with_the_same_global_batch_continues_the_run(
    tmp_path: Path, world: int, batch: int, full_and_part: Path
) -> None:
    """2 ranks x batch 2 x accum 2 to step 10, then 1 rank x 4 (or 4 x 1) to step 20: the
    same samples make every step, so the weights end as an uninterrupted 2-rank run's,
    to fp32 round-off; a different global batch is refused with one line."""
    shutil.copytree(full_and_part / "part", tmp_path / "part")
    part = {"config": _cfg(tmp_path / "part", max_steps=20, batch_size=batch), "n": 160}
    bad = json.loads(json.dumps(part))
    bad["config"]["training"]["accum"] = 1
    rc, out, err = _run(bad, world=world)[0]
    assert rc != 0 and "batch_size x accum x ranks equal to the checkpoint's 8" in err, err
    _ok(_run(part, world=world))
    a, b = _final(full_and_part / "full"), _final(tmp_path / "part")
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), (k, (a[k] - b[k]).abs().max())


def test_a_kill_while_pruning_leaves_no_partial_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pruned checkpoint directory disappears at once (renamed to a hidden name before
    it is deleted): a kill during the deletion leaves nothing that looks like step_N,
    and a later save removes what is left."""
    import shutil

    from ddp import checkpoint as ckpt

    cp, loop, model = _one_rank_checkpointer(tmp_path)
    cp.save(loop, model, TrainState(3))
    cp.wait()
    rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # killed before deleting
    ckpt.remove_checkpoint(tmp_path / "step_000000003")
    assert not (tmp_path / "step_000000003").exists() and ckpt.list_checkpoints(tmp_path) == []
    assert (tmp_path / ".step_000000003.old" / "meta.pt").is_file()
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    cp.save(loop, model, TrainState(5))
    cp.wait()
    assert sorted(p.name for p in tmp_path.iterdir() if "step" in p.name) == ["step_000000005"]
