"""Issue 28, item 2: each rank's checkpoint state stays its own. Every rank writes its RNG
states into its own small file beside the model's file and reads only that one on
resume; nothing gathers them, so the bytes a save moves per rank, the size of any file
and a rank's resume work do not grow with the number of ranks. A rank file is untrusted
input like the checkpoint; checkpoints of the earlier layout (every rank's states in one
list) still resume."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp import checkpoint as ckpt
from ddp.checkpoint.loop import TrainState
from ddp.errors import ConfigError
from tests.ddp import _launch
from tests.ddp.test_checkpoint_hostile import (
    _bounded,
    _checkpointer,
    _one_line,
    _resume,
    _set,
    old_layout,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests/ddp/_train_worker.py"


def _two_saves(ck: Path, strategy: str, world: int = 1):
    """Steps 2 and 3 saved (step 3 the newest); the draws the RNG gives after step 3."""
    cp, loop, model = _checkpointer(ck, strategy, background=False)
    if world != 1:
        cp.ctx = dataclasses.replace(cp.ctx, world_size=world)
    cp.save(loop, model, TrainState(2))
    cp.save(loop, model, TrainState(3))
    return torch.rand(4), ckpt.find_latest(ck)


def _resumed(ck: Path, strategy: str, resume: str = "auto") -> tuple[dict, torch.Tensor]:
    cp, _, model = _checkpointer(ck, strategy)
    cp.config.checkpoint.resume = resume
    torch.manual_seed(99)  # whatever the process had: the resume must set it
    state = _resume(cp, model)
    return state, torch.rand(4)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_ranks_state_is_its_own_file_beside_the_model(tmp_path: Path, strategy: str) -> None:
    after, newest = _two_saves(tmp_path, strategy)
    assert newest is not None
    saved = torch.load(newest / ckpt.META if newest.is_dir() else newest, weights_only=True)
    assert "rng" not in saved and saved["rank_files"] is True  # no gathered list
    ranks = ckpt.rank_dir(newest)
    assert ranks == (newest if strategy == "fsdp" else tmp_path / "step_000000003.ranks")
    assert sorted(p.name for p in ranks.glob("rank_*")) == ["rank_000000.pt"]
    assert (ranks / "rank_000000.pt").stat().st_size < 64 << 10
    state, drawn = _resumed(tmp_path, strategy)
    assert state["global_step"] == 3
    assert torch.equal(drawn, after)  # this rank's streams exactly where the save left them


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_of_the_earlier_layout_still_resumes_with_its_rng_states(
    tmp_path: Path, strategy: str
) -> None:
    """Written before rank files (format 2): every rank's states in one list; this rank's
    is taken from it, as before."""
    after, newest = _two_saves(tmp_path, strategy)
    old_layout(newest)
    assert not [f for f in tmp_path.rglob("rank_*.pt") if "000000003" in str(f)]
    assert ckpt.load_checkpoint(newest)["format"] == 2
    state, drawn = _resumed(tmp_path, strategy, str(newest))
    assert state["global_step"] == 3 and torch.equal(drawn, after)


def test_a_resume_reads_only_its_own_rank_file_whatever_the_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of 64 (the other 63 pretended): it reads rank_000000.pt and no other, so its
    resume work is that of one rank; a single process that checks the whole checkpoint
    reads every rank's file (and finds the 63 missing here)."""
    after, newest = _two_saves(tmp_path, "ddp", world=64)
    read: list[int] = []
    real = ckpt.read_rank_state

    def counted(checkpoint: Path, rank: int, saved: dict) -> dict:
        read.append(rank)
        return real(checkpoint, rank, saved)

    monkeypatch.setattr(ckpt, "read_rank_state", counted)
    cp, _, model = _checkpointer(tmp_path)
    cp.ctx = dataclasses.replace(cp.ctx, world_size=64)
    torch.manual_seed(99)
    state = _resume(cp, model)
    assert state["world_size"] == 64 and read == [0]
    assert torch.equal(torch.rand(4), after)
    with pytest.raises(ConfigError, match="misses its rank file step_000000003.ranks/rank_000001"):
        ckpt.load_checkpoint(newest)


# ---- a crafted, damaged or missing rank file -------------------------------------------------
def _rewrite_rank(path: Path, change) -> None:
    """Change a rank file's contents and give it a matching digest line (crafted)."""
    head, _, payload = path.read_bytes().partition(b"\n")
    obj = torch.load(io.BytesIO(payload), weights_only=True)
    change(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    path.write_bytes(
        b"ddp-rank-state sha256=" + hashlib.sha256(data).hexdigest().encode() + b"\n" + data
    )


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ddp-rank-file-ran-code",))


def _evil(path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"format": 3, "global_step": 3, "x": _Evil()}, buf)
    data = buf.getvalue()
    path.write_bytes(
        b"ddp-rank-state sha256=" + hashlib.sha256(data).hexdigest().encode() + b"\n" + data
    )


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01
    path.write_bytes(bytes(data))


def _replace_with(kind: str):
    def change(path: Path) -> None:
        other = path.parent.parent / "step_000000002.ranks" / path.name
        path.unlink()
        if kind == "pipe":
            os.mkfifo(path)
        elif kind == "symlink":
            path.symlink_to(other if other.exists() else path.parent / ".." / "elsewhere")
        elif kind == "huge":
            path.write_bytes(b"ddp-rank-state sha256=" + b"0" * (ckpt.RANK_FILE_LIMIT + 1))

    return change


_CASES = {
    "missing": (lambda p: p.unlink(), "misses its rank file"),
    "not ddp's": (lambda p: p.write_bytes(b"hello\x00\xff"), "no digest line"),
    "flipped byte": (_flip, r"damaged rank file .*digest mismatch"),
    "named pipe": (_replace_with("pipe"), "named pipe"),
    "symbolic link": (_replace_with("symlink"), "symbolic link"),
    "huge": (_replace_with("huge"), "allowed: at most"),
    "pickled code": (_evil, "safe load refuses"),
    "rng not a mapping": (lambda p: _rewrite_rank(p, _set("rank_rng", "x")), "rank_rng"),
    "python rng": (lambda p: _rewrite_rank(p, _set("rank_rng/python", "seed")), "rank_rng.python"),
    "torch rng": (
        lambda p: _rewrite_rank(p, _set("rank_rng/torch", torch.zeros(3, dtype=torch.uint8))),
        "rank_rng.torch",
    ),
    "numpy rng": (
        lambda p: _rewrite_rank(p, _set("rank_rng/numpy", ("MT19937", [1], 0, 0, float("nan")))),
        "rank_rng.numpy",
    ),
    "no rng": (lambda p: _rewrite_rank(p, lambda o: o.pop("rank_rng")), "rank_rng"),
    "another rank's": (lambda p: _rewrite_rank(p, _set("rank", 1)), "rank"),
    "another step's": (lambda p: _rewrite_rank(p, _set("global_step", 2)), "global_step"),
    "another world's": (lambda p: _rewrite_rank(p, _set("world_size", 2)), "world_size"),
    "rank as text": (lambda p: _rewrite_rank(p, _set("rank", "0")), "rank"),
    "newer format": (lambda p: _rewrite_rank(p, _set("format", 99)), "format"),
    "another rank's shard": (
        lambda p: _rewrite_rank(p, _set("rank_shards", {"__1_0.distcp": "0" * 64})),
        "rank_shards",
    ),
}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", list(_CASES))
def test_a_crafted_damaged_or_missing_rank_file_is_one_line_or_the_one_before(
    tmp_path: Path, strategy: str, case: str
) -> None:
    """checkpoint.resume=PATH stops with one line naming the rank file and what is wrong
    with it (never a hang, a traceback or code run); auto-resume skips that checkpoint
    for the one before, as for a damaged checkpoint file."""
    damage, needle = _CASES[case]
    after, newest = _two_saves(tmp_path, strategy)
    victim = ckpt.rank_dir(newest) / "rank_000000.pt"
    damage(victim)
    done, err = _bounded(lambda: ckpt.load_checkpoint(newest))
    assert done, "hung"
    assert isinstance(err, ConfigError), repr(err)
    assert "rank_000000.pt" in str(err) and re.search(needle, str(err)), str(err)
    with pytest.raises(ConfigError, match=needle) as exc:
        _resumed(tmp_path, strategy, str(newest))
    line = _one_line(exc)
    assert line.startswith(f"checkpoint.resume: {str(newest)!r}") and "rank_000000.pt" in line
    state, _ = _resumed(tmp_path, strategy)
    assert state["global_step"] == 2  # the one before
    assert not Path("/tmp/ddp-rank-file-ran-code").exists()


def test_a_rank_directory_that_is_a_symbolic_link_is_one_line(tmp_path: Path) -> None:
    """``step_N.ranks`` pointing elsewhere (another run's rank files, any directory)."""
    _, newest = _two_saves(tmp_path, "ddp")
    ranks = ckpt.rank_dir(newest)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    ranks.rename(elsewhere)
    ranks.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="step_000000003.ranks that is a symbolic link") as exc:
        _resumed(tmp_path, "ddp", str(newest))
    _one_line(exc)
    assert _resumed(tmp_path, "ddp")[0]["global_step"] == 2


# ---- saves: what is left behind, and what is never touched ----------------------------------
def test_a_save_removes_older_staging_and_never_a_later_steps(tmp_path: Path) -> None:
    """Rank files are staged in ``.step_N.ranks.tmp``; rank 0 finishing step N removes
    the staging left by a killed run for earlier steps, but never a later step's, which
    other ranks may be writing while rank 0 finishes this one."""
    cp, loop, model = _checkpointer(tmp_path, background=False)
    for step in (1, 9):
        stale = tmp_path / f".step_{step:09d}.ranks.tmp"
        stale.mkdir(parents=True)
        (stale / "rank_000003.pt").write_bytes(b"x")
    cp.save(loop, model, TrainState(4))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        ".step_000000009.ranks.tmp",
        "latest",
        "step_000000004.pt",
        "step_000000004.pt.sha256",
        "step_000000004.ranks",
    ], left


def test_pruning_removes_a_checkpoints_rank_files_with_it(tmp_path: Path) -> None:
    cp, loop, model = _checkpointer(tmp_path, background=False)
    for step in (1, 2, 3):
        cp.save(loop, model, TrainState(step))
    assert sorted(p.name for p in tmp_path.iterdir() if "ranks" in p.name) == [
        "step_000000002.ranks",
        "step_000000003.ranks",
    ]


def test_a_save_over_a_checkpoint_of_the_same_step_replaces_its_rank_files(tmp_path: Path) -> None:
    """A run resumed from an older checkpoint saves the same steps again: the old step's
    rank files never mix with the new checkpoint."""
    cp, loop, model = _checkpointer(tmp_path, background=False)
    cp.save(loop, model, TrainState(2))
    extra = tmp_path / "step_000000002.ranks" / "rank_000005.pt"
    extra.write_bytes(b"from an older run of 8 ranks")
    torch.rand(3)
    cp.save(loop, model, TrainState(2))
    assert not extra.exists()
    assert ckpt.load_checkpoint(ckpt.step_path(tmp_path, 2))["global_step"] == 2


# ---- real ranks --------------------------------------------------------------------------------
def test_bytes_received_per_rank_per_save_do_not_grow_with_the_world(tmp_path: Path) -> None:
    """bench/scale_ckpt.py at 2 and 4 Gloo ranks: the collectives of one save carry the
    same bytes to each rank (two all-reduces of one integer), and each rank's file is
    the same size; before, every rank received every other rank's RNG states."""
    import ddp

    out = tmp_path / "scale.json"
    src = Path(ddp.__file__).resolve().parents[1]  # the ddp under test
    proc = subprocess.run(
        [
            sys.executable,
            "bench/scale_ckpt.py",
            "--worlds",
            "2,4",
            "--json",
            str(out),
            "--src",
            str(src),
        ],
        cwd=ROOT,
        env=_launch.base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    two, four = json.loads(out.read_text())["rows"]
    assert four["received_max"] == two["received_max"] <= 64, (two, four)
    assert abs(four["largest"] - two["largest"]) < 1024 and four["largest"] < 64 << 10, (two, four)
    assert set(four["calls"]) == {"all_reduce"}, four["calls"]


def _train(ck: Path, world: int, **checkpoint: object) -> list[tuple[int, str, str]]:
    cfg = {
        "training": {"batch_size": 2, "epochs": 1, "seed": 5, "max_steps": 4},
        "optim": {"name": "sgd", "lr": 0.05},
        "checkpoint": {"dir": str(ck), "every_n_steps": 2, "keep_last": 2, **checkpoint},
        "logging": {"every_n_steps": 50, "progress": "plain"},
    }
    if "max_steps" in checkpoint:
        cfg["training"]["max_steps"] = checkpoint.pop("max_steps")
        cfg["checkpoint"].pop("max_steps")
    return _launch.run(
        [WORKER, json.dumps({"config": cfg, "n": 64, "dropout": 0.2})], world=world, timeout=120
    )


def test_a_bad_rank_file_of_one_rank_is_every_ranks_line_or_the_checkpoint_before(
    tmp_path: Path,
) -> None:
    """Rank 1's file of step 4 is damaged: only rank 1 reads it, and all ranks agree
    (one all-reduce): with checkpoint.resume naming it, both stop with the same line
    (exit 2); with auto, both resume from step 2."""
    ck = tmp_path / "ck"
    for rank, (rc, out, err) in enumerate(_train(ck, 2)):
        assert rc == 0, f"rank {rank}: {rc}\n{out[-2000:]}\n{err[-3000:]}"
    _flip(ck / "step_000000004.ranks" / "rank_000001.pt")
    results = _train(ck, 2, resume=str(ck / "step_000000004.pt"), max_steps=6)
    want = "damaged rank file step_000000004.ranks/rank_000001.pt (digest mismatch)"
    for rank, (rc, _, err) in enumerate(results):
        lines = [line for line in err.splitlines() if "error" in line]
        assert rc == 2 and len(lines) == 1 and want in lines[0], f"rank {rank}: {err[-3000:]}"
    results = _train(ck, 2, max_steps=6)
    assert [rc for rc, _, _ in results] == [0, 0], [r[2][-3000:] for r in results]
    assert "resuming from" in results[0][1] and "step_000000002.pt" in results[0][1]
    assert "rank_000001.pt" in results[0][1] + results[0][2]  # said why, once


def test_a_damaged_shard_is_found_by_the_rank_standing_for_its_writer(tmp_path: Path) -> None:
    """FSDP, 2 ranks saved: each rank file lists its own shards' digests, and on resume
    each rank checks the shards of the saved ranks it stands for (rank 0 alone checks both
    on 1 rank; rank 1 checks __1_0 on 2): either way the damaged shard is one line."""
    ck = tmp_path / "ck"
    cfg = {
        "training": {"batch_size": 2, "epochs": 1, "seed": 5, "max_steps": 2},
        "optim": {"name": "adamw", "lr": 0.01},
        "ddp": {"strategy": "fsdp", "fsdp_blocks": ["0", "3"]},
        "checkpoint": {"dir": str(ck)},
        "logging": {"progress": "plain"},
    }
    spec = {"config": cfg, "n": 64}
    for rank, (rc, out, err) in enumerate(
        _launch.run([WORKER, json.dumps(spec)], world=2, timeout=120)
    ):
        assert rc == 0, f"rank {rank}: {rc}\n{out[-2000:]}\n{err[-3000:]}"
    step = ckpt.sharded_path(ck, 2)
    assert sorted(p.name for p in step.glob("rank_*")) == ["rank_000000.pt", "rank_000001.pt"]
    _flip(step / "__1_0.distcp")
    cfg["checkpoint"]["resume"] = str(step)
    cfg["training"]["max_steps"] = 4
    for world in (1, 2):  # one process raises the ConfigError itself; ranks exit 2
        results = _launch.run([WORKER, json.dumps(spec)], world=world, timeout=120)
        for rank, (rc, _, err) in enumerate(results):
            line = err.strip().splitlines()[-1]
            assert rc == (1 if world == 1 else 2), f"{world}/{rank}: {err[-3000:]}"
            assert "damaged shard __1_0.distcp" in line, f"{world}/{rank}: {err[-3000:]}"


@pytest.fixture(autouse=True)
def _no_leftover_marker() -> None:
    Path("/tmp/ddp-rank-file-ran-code").unlink(missing_ok=True)
    yield
    Path("/tmp/ddp-rank-file-ran-code").unlink(missing_ok=True)


_FAIL_RANK_FILE = """
import errno, runpy, sys
from ddp import checkpoint as ckpt
real = ckpt.write_rank_state
def failing(directory, rank, state):
    if rank == 1 and state["global_step"] == 4:
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "x"))
    return real(directory, rank, state)
ckpt.write_rank_state = failing
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_failed_rank_file_write_on_one_rank_stops_every_rank_with_its_line(
    tmp_path: Path,
) -> None:
    """Rank 1 cannot write its file of step 4 (ENOSPC): every rank stops (exit 2, no
    hang) with rank 1's line, found by one all-reduce; step 2 stays `latest` and nothing
    of step 4 is left."""
    ck = tmp_path / "ck"
    cfg = {
        "training": {"batch_size": 2, "epochs": 1, "seed": 5, "max_steps": 6},
        "optim": {"name": "sgd", "lr": 0.05},
        "checkpoint": {"dir": str(ck), "every_n_steps": 2, "keep_last": 2},
        "logging": {"every_n_steps": 50, "progress": "plain"},
    }
    results = _launch.run(
        ["-c", _FAIL_RANK_FILE, WORKER, json.dumps({"config": cfg, "n": 64})], world=2, timeout=120
    )
    want = "No space left on device; the earlier checkpoints are kept"
    for rank, (rc, _, err) in enumerate(results):
        lines = [line for line in err.splitlines() if "ddp: error:" in line]
        assert rc == 2 and len(lines) == 1, f"rank {rank}: {rc} {err[-3000:]}"
        assert want in lines[0] and "(rank 1)" in lines[0], lines
    assert (ck / "latest").read_text().strip() == "step_000000002.pt"
    assert sorted(p.name for p in ck.iterdir() if "000000004" in p.name) == []
