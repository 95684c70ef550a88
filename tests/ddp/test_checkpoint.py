"""Atomic checkpoints: pointer, pruning, fallback on damage, survival of kill -9."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddp import checkpoint as ckpt
from tests.ddp._launch import base_env


def test_save_load_latest_and_prune(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint({"global_step": step}, tmp_path, step, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_000000003.pt",
        "step_000000004.pt",
    ]
    assert (tmp_path / "latest").read_text().strip() == "step_000000004.pt"
    path, state = ckpt.load_latest(tmp_path)
    assert state["global_step"] == 4 and path.name == "step_000000004.pt"
    assert not list(tmp_path.glob(".*tmp"))


def test_damaged_latest_falls_back(tmp_path: Path) -> None:
    for step in (1, 2):
        ckpt.save_checkpoint({"global_step": step}, tmp_path, step, keep_last=3)
    (tmp_path / "step_000000002.pt").write_bytes(b"garbage")
    _, state = ckpt.load_latest(tmp_path)
    assert state["global_step"] == 1
    assert ckpt.load_latest(tmp_path / "nothing") is None


def test_model_state_has_no_module_prefix() -> None:
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    assert set(ckpt.model_state(Wrapper())) == {"weight", "bias"}


def test_rng_roundtrip() -> None:
    state = ckpt.rng_state(torch.device("cpu"))
    a = (random.random(), torch.rand(3))
    ckpt.set_rng_state(state, torch.device("cpu"))
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


SAVER = """
import sys, torch
from ddp import checkpoint as ckpt
d = sys.argv[1]
big = torch.empty(4_000_000)  # 16 MB per checkpoint
step = 0
while True:
    step += 1
    big.fill_(float(step))
    ckpt.save_checkpoint({"global_step": step, "big": big}, d, step, keep_last=2)
"""


def test_kill_9_during_save_never_corrupts_latest(tmp_path: Path) -> None:
    rng = random.Random(0)
    for round_ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)], env=base_env())
        try:
            # poll until the saver has moved `latest` a random number of times, then kill at
            # whatever point of the next save it has reached
            want = rng.randint(1, 3)
            seen: set[str] = set()
            deadline = time.monotonic() + 60
            while len(seen) < want:
                assert proc.poll() is None, "saver died"
                assert time.monotonic() < deadline, "saver made no progress"
                try:
                    seen.add((tmp_path / "latest").read_text())
                except FileNotFoundError:
                    pass
            time.sleep(rng.random() * 0.05)  # land the kill at a random point of a save
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        found = ckpt.load_latest(tmp_path)
        assert found is not None, f"round {round_}: no loadable checkpoint"
        path, state = found
        assert path == ckpt.find_latest(tmp_path), "latest pointed at an unreadable file"
        assert torch.all(state["big"] == float(state["global_step"]))
