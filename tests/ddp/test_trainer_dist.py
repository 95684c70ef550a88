"""Real 2-rank Gloo runs of the Trainer: equivalence, exact eval, resume, failure, export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ddp import _launch
from tests.ddp._train_worker import make_data, make_model

WORKER = "tests/ddp/_train_worker.py"


def _cfg(tmp: Path | None, **sections: dict) -> dict:
    cfg: dict = {
        "training": {"batch_size": 4, "epochs": 1, "shuffle": False},
        "optim": {"name": "sgd", "lr": 0.1},
        "checkpoint": {"dir": str(tmp) if tmp else None},
        "logging": {"every_n_steps": 3, "progress": "plain"},
        "preemption": {"check_interval_s": 0},  # a vote every step: signals act mid-epoch
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def _run(spec: dict, world: int, timeout: float = 60.0) -> list[tuple[int, str, str]]:
    return _launch.run([WORKER, json.dumps(spec)], world=world, timeout=timeout)


def _ok(results: list[tuple[int, str, str]]) -> None:
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{out[-2000:]}\n{err[-3000:]}"


def _state(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max())


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Same 64 samples, same order: 2 ranks x B4, 2 ranks x B2 x accum 2, 1 x B8."""
    tmp = tmp_path_factory.mktemp("eq")
    runs = {
        "two_ranks": (2, {"batch_size": 4}),
        "two_ranks_accum": (2, {"batch_size": 2, "accum": 2}),
        "one_rank": (1, {"batch_size": 8}),
        "one_rank_accum": (1, {"batch_size": 4, "accum": 2}),
    }
    procs = {}
    for name, (world, training) in runs.items():  # all four jobs run at once
        spec = {
            "config": _cfg(None, training=training),
            "n": 64,
            "eval_n": 101,
            "out": str(tmp / f"{name}.pt"),
        }
        procs[name] = _launch.start([WORKER, json.dumps(spec)], world=world)
    for procs_ in procs.values():
        _ok(_launch.finish(procs_, timeout=90))
    return {name: _state(tmp / f"{name}.pt") for name in runs}


def test_two_ranks_equal_one_process_with_double_batch(equivalence: dict) -> None:
    one = equivalence["one_rank"]["state"]
    _assert_same(equivalence["two_ranks"]["state"], one, 1e-5)
    _assert_same(equivalence["two_ranks_accum"]["state"], one, 1e-5)
    assert equivalence["two_ranks"]["summary"]["steps"] == 8
    # the runs really trained: weights moved from the initial ones
    init = make_model().state_dict()
    assert not torch.allclose(init["0.weight"], one["0.weight"])


def test_accum_equals_double_batch(equivalence: dict) -> None:
    _assert_same(equivalence["one_rank_accum"]["state"], equivalence["one_rank"]["state"], 1e-6)


def test_exact_eval_on_uneven_size(equivalence: dict) -> None:
    two = equivalence["two_ranks"]["summary"]["eval_loss"]
    one = equivalence["one_rank"]["summary"]["eval_loss"]
    model = make_model()
    model.load_state_dict(equivalence["one_rank"]["state"])
    x, y = make_data(101, seed=1).tensors
    with torch.no_grad():
        direct = torch.nn.functional.mse_loss(model(x), y).item()
    assert one == pytest.approx(direct, rel=1e-6)
    assert two == pytest.approx(one, rel=1e-6)


def _wait_for(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"a rank exited early: {dead}"
        assert time.monotonic() < deadline, "ranks never reached the signal step"
        time.sleep(0.02)


def test_resume_after_signal_matches_uninterrupted(tmp_path: Path) -> None:
    """SIGUSR1 to both ranks mid-epoch -> exit 75 + checkpoint -> resume == uninterrupted."""
    sections = {
        "training": {"shuffle": True, "epochs": 2, "seed": 7},
        "optim": {"name": "adamw", "lr": 0.01, "warmup_steps": 2, "schedule": "linear"},
    }
    full = {
        "config": _cfg(tmp_path / "full", **sections),
        "n": 64,
        "dropout": 0.2,
        "out": str(tmp_path / "full.pt"),
    }
    full_procs = _launch.start([WORKER, json.dumps(full)], world=2)

    ready = tmp_path / "ready"
    ready.mkdir()
    part = {
        "config": _cfg(tmp_path / "part", **sections),
        "n": 64,
        "dropout": 0.2,
        "out": str(tmp_path / "part.pt"),
        "wait_signal_step": 3,
        "ready_dir": str(ready),
    }
    procs = _launch.start([WORKER, json.dumps(part)], world=2)
    pids = [ready / "0.pid", ready / "1.pid"]
    _wait_for(pids, procs, timeout=60)
    for p in pids:
        os.kill(int(p.read_text()), signal.SIGUSR1)
    results = _launch.finish(procs, timeout=60)
    from ddp.trainer import PREEMPTED_EXIT_CODE

    assert [r[0] for r in results] == [PREEMPTED_EXIT_CODE] * 2, results
    assert (
        tmp_path / "part" / "latest"
    ).read_text().strip() == "step_000000005.pt"  # signalled in step 4, agreed at 5
    assert not (tmp_path / "part.pt").exists()

    part.pop("wait_signal_step")
    _ok(_launch.run([WORKER, json.dumps(part)], world=2))
    _ok(_launch.finish(full_procs))
    a, b = _state(tmp_path / "part.pt"), _state(tmp_path / "full.pt")
    assert a["summary"]["steps"] == b["summary"]["steps"] == 16
    _assert_same(a["state"], b["state"], 0.0)


def test_resume_after_max_steps_matches_uninterrupted(tmp_path: Path) -> None:
    """One process: stop at max_steps=5 (mid-epoch), resume, compare with one straight run."""
    sections = {
        "training": {"shuffle": True, "epochs": 2, "seed": 3, "batch_size": 8},
        "optim": {"name": "adamw", "lr": 0.01, "warmup_steps": 3},
    }
    full = {
        "config": _cfg(tmp_path / "full", **sections),
        "n": 64,
        "dropout": 0.2,
        "out": str(tmp_path / "full.pt"),
    }
    part_cfg = _cfg(tmp_path / "part", **sections)
    part_cfg["training"]["max_steps"] = 5
    part = {"config": part_cfg, "n": 64, "dropout": 0.2, "out": str(tmp_path / "part.pt")}
    procs = [_launch.start([WORKER, json.dumps(s)], world=1) for s in (full, part)]
    for p in procs:
        _ok(_launch.finish(p))
    assert _state(tmp_path / "part.pt")["summary"]["steps"] == 5
    part_cfg["training"]["max_steps"] = None
    _ok(_launch.run([WORKER, json.dumps(part)], world=1))
    a, b = _state(tmp_path / "part.pt"), _state(tmp_path / "full.pt")
    assert a["summary"]["steps"] == b["summary"]["steps"] == 16
    _assert_same(a["state"], b["state"], 0.0)


def test_failure_on_one_rank_ends_all_ranks_promptly(tmp_path: Path) -> None:
    spec = {"config": _cfg(None), "n": 64, "fail_rank": 1, "fail_step": 3}
    t0 = time.monotonic()
    results = _run(spec, world=2, timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed < 60
    assert all(rc != 0 for rc, _, _ in results), [r[0] for r in results]
    assert "rank 1 failed: RuntimeError: injected failure" in results[1][2]
    assert "killed at the" not in results[0][2] + results[1][2]


EXPORT_CHECK = """
import sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 1))
model.load_state_dict(torch.load(sys.argv[1], weights_only=True))
model.eval()
x = torch.linspace(-1, 1, 24).reshape(3, 8)
assert "ddp" not in sys.modules
print(repr(model(x).detach().flatten().tolist()))
"""


def test_export_loads_with_plain_torch(tmp_path: Path) -> None:
    spec = {"config": _cfg(tmp_path / "ck"), "n": 32, "out": str(tmp_path / "out.pt")}
    _ok(_run(spec, world=2))
    final = tmp_path / "ck" / "final"
    assert (final / "config.yaml").is_file()
    out = subprocess.run(
        [sys.executable, "-c", EXPORT_CHECK, str(final / "model.pt")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert out.returncode == 0, out.stderr
    model = make_model()
    model.load_state_dict(_state(tmp_path / "out.pt")["state"])
    model.eval()
    with torch.no_grad():
        want = model(torch.linspace(-1, 1, 24).reshape(3, 8)).flatten().tolist()
    assert eval(out.stdout) == pytest.approx(want, abs=1e-7)


def test_rerun_of_a_finished_max_steps_run_trains_nothing_more(tmp_path: Path) -> None:
    spec = {
        "config": _cfg(tmp_path / "ck", training={"max_steps": 3}),
        "n": 64,
        "out": str(tmp_path / "out.pt"),
    }
    _ok(_run(spec, world=1))
    first = _state(tmp_path / "out.pt")
    _ok(_run(spec, world=1))  # resume: auto finds step 3 and stops there
    second = _state(tmp_path / "out.pt")
    assert first["summary"]["steps"] == second["summary"]["steps"] == 3
    _assert_same(first["state"], second["state"], atol=0)
    assert not list((tmp_path / "ck").glob("step_000000004*"))
