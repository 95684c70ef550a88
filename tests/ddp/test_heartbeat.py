"""Heartbeats and on-demand stacks for a watcher outside the ranks (issue 30, item 1)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from ddp.heartbeat import Heartbeat
from tests.ddp import _launch

WORKER = "tests/ddp/_train_worker.py"


def _wait_for(pred, timeout: float = 60.0) -> None:
    """Poll an event (a file appearing); the bound is only against a true hang."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "event never happened"
        time.sleep(0.02)


def test_beats_are_throttled_and_atomic(tmp_path: Path) -> None:
    hb = Heartbeat(tmp_path / "hb", rank=3, every_s=3600)
    hb.beat(5)
    hb.beat(6)  # within every_s: not written
    rec = json.loads((tmp_path / "hb" / "rank-3.json").read_text())
    assert (rec["rank"], rec["step"], rec["phase"], rec["pid"]) == (3, 5, "train", os.getpid())
    hb.beat(7, "eval", force=True)  # a phase change is written at once
    rec = json.loads((tmp_path / "hb" / "rank-3.json").read_text())
    assert (rec["step"], rec["phase"]) == (7, "eval")
    assert [p.name for p in (tmp_path / "hb").iterdir()] == ["rank-3.json"]  # no temp left


def test_every_rank_publishes_its_step(tmp_path: Path, monkeypatch) -> None:
    hb = tmp_path / "heartbeats"
    monkeypatch.setenv("DDP_HEARTBEAT_DIR", str(hb))
    monkeypatch.setenv("DDP_HEARTBEAT_EVERY_S", "0")
    spec = {
        "n": 64,
        "config": {
            "training": {"batch_size": 4, "epochs": 1, "max_steps": 5},
            "optim": {"name": "sgd", "lr": 0.01},
            "checkpoint": {"dir": None},
            "logging": {"progress": "off"},
        },
    }
    procs = _launch.start([WORKER, json.dumps(spec)], world=2)
    pids = [p.pid for p in procs]
    results = _launch.finish(procs, timeout=120)
    for rank, (rc, _out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}: {err[-3000:]}"
        rec = json.loads((hb / f"rank-{rank}.json").read_text())
        assert rec["rank"] == rank and rec["step"] == 5 and rec["pid"] == pids[rank]
        assert rec["host"] and rec["time"] > 0


def test_stack_signal_dumps_where_a_rank_waits(tmp_path: Path, monkeypatch) -> None:
    """SIGUSR2 to a rank spinning inside its step function writes its Python stack."""
    hb, ready = tmp_path / "heartbeats", tmp_path / "ready"
    ready.mkdir()
    monkeypatch.setenv("DDP_HEARTBEAT_DIR", str(hb))
    spec = {
        "n": 64,
        "wait_signal_step": 2,
        "ready_dir": str(ready),
        "wait_timeout": 60,
        "config": {
            "training": {"batch_size": 4, "epochs": 1, "max_steps": 4},
            "optim": {"name": "sgd", "lr": 0.01},
            "checkpoint": {"dir": None},
            "logging": {"progress": "off"},
        },
    }
    procs = _launch.start([WORKER, json.dumps(spec)], world=2)
    try:
        _wait_for(lambda: (ready / "0.pid").exists() and (ready / "1.pid").exists())
        stack = hb / "stack-rank-0.txt"
        os.kill(procs[0].pid, signal.SIGUSR2)
        # the whole dump: faulthandler writes it a few bytes at a time, the main thread
        # last, whose outermost frame is the worker script's <module>
        _wait_for(lambda: "in <module>\n" in stack.read_text())
        text = stack.read_text()
        assert "Most recent call first" in text or "File " in text
        assert "in step" in text  # the frame it waits in: the step function's spin loop
        for p in procs:
            os.kill(p.pid, signal.SIGUSR1)  # the preemption signal ends the spin
    finally:
        results = _launch.finish(procs, timeout=120)
    assert {rc for rc, _, _ in results} <= {0, 75, 143}, [e[-2000:] for _, _, e in results]


def test_no_heartbeats_without_a_supervisor(monkeypatch, tmp_path: Path) -> None:
    """A job `hpc submit` made ($HPC_RUN_DIR) but no supervisor: no files every 2 s per
    rank on a shared file system, and SIGUSR2 left to the application."""
    from ddp.heartbeat import heartbeat_dir

    monkeypatch.delenv("DDP_HEARTBEAT_DIR", raising=False)
    monkeypatch.setenv("HPC_RUN_DIR", str(tmp_path))
    assert heartbeat_dir() is None
    monkeypatch.setenv("DDP_HEARTBEAT_DIR", str(tmp_path / "hb"))
    assert heartbeat_dir() == tmp_path / "hb"
