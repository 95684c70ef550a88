"""What a run leaves to look at: metrics.jsonl, TensorBoard events, a W&B offline run
(issue 17 items 1 and 4), from real 2-rank Gloo runs of the Trainer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.ddp import _launch
from tests.support.parts import require_module

WORKER = "tests/ddp/_train_worker.py"


def _cfg(ck: Path, **logging: object) -> dict:
    return {
        "training": {"batch_size": 4, "epochs": 2, "shuffle": True, "seed": 3},
        "optim": {"name": "sgd", "lr": 0.05},
        "checkpoint": {"dir": str(ck)},
        "logging": {"every_n_steps": 1, "progress": "plain", **logging},
    }


def _ok(results: list[tuple[int, str, str]]) -> None:
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{out[-2000:]}\n{err[-3000:]}"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_jsonl_has_every_log_point_and_evaluation(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _ok(_launch.run([WORKER, json.dumps({"config": _cfg(ck), "n": 32, "eval_n": 8})], world=2))
    recs = _lines(ck / "metrics.jsonl")
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 9))  # 32 / (4 x 2) x 2 epochs
    for key in ("epoch", "time", "loss", "lr", "samples_per_s", "memory_mb"):
        assert all(key in r for r in train), key
    assert evals and all("eval_loss" in r for r in evals)
    assert train[0]["loss"] > train[-1]["loss"]  # the numbers are the run's, not zeros


def test_metrics_are_not_duplicated_across_a_resume(tmp_path: Path) -> None:
    """Steps logged after the last checkpoint (a crash) are logged again on resume, once."""
    ck = tmp_path / "ck"
    cfg = _cfg(ck)
    cfg["checkpoint"]["every_n_steps"] = 2
    cfg["training"]["max_steps"] = 3  # saves at 2 and 3; pretend 3 was never written
    _ok(_launch.run([WORKER, json.dumps({"config": cfg, "n": 32})], world=2))
    for p in ck.glob("step_000000003*"):  # the checkpoint and its ranks' folder
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (ck / "latest").write_text("step_000000002.pt\n")
    cfg["training"]["max_steps"] = None
    _ok(_launch.run([WORKER, json.dumps({"config": cfg, "n": 32})], world=2))
    steps = [r["step"] for r in _lines(ck / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 9)), steps


def test_tensorboard_events_hold_the_logged_scalars(tmp_path: Path) -> None:
    require_module("tensorboard", reason="tensorboard is in the test extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ck = tmp_path / "ck"
    _ok(
        _launch.run(
            [WORKER, json.dumps({"config": _cfg(ck, tensorboard=True), "n": 32, "eval_n": 8})],
            world=2,
        )
    )
    acc = EventAccumulator(str(ck / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "eval_loss"} <= set(tags), tags
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 9))
    want = [r["loss"] for r in _lines(ck / "metrics.jsonl") if r["kind"] == "train"]
    got = [e.value for e in acc.Scalars("train/loss")]
    assert got == pytest.approx(want, rel=1e-6)


def test_wandb_offline_run_holds_the_logged_scalars(tmp_path: Path, monkeypatch) -> None:
    require_module("wandb", reason="wandb is in the test extra")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    ck = tmp_path / "ck"
    cfg = _cfg(ck, wandb={"project": "hpc-ddp-test", "mode": "offline"})
    _ok(_launch.run([WORKER, json.dumps({"config": cfg, "n": 32, "eval_n": 8})], world=2))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 only
    # wandb 0.31 reads its own record log in Go only; the history records keep each
    # metric's key and its value as JSON text, so both are looked for in the bytes.
    (history,) = runs[0].glob("run-*.wandb")
    data = history.read_bytes()
    train = [r for r in _lines(ck / "metrics.jsonl") if r["kind"] == "train"]
    assert data.count(b"train/loss") >= len(train) and b"eval_loss" in data
    for rec in train:
        assert json.dumps(rec["loss"]).encode() in data, rec
