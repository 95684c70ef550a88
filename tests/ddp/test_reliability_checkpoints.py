"""Issue 10, checkpoints: crafted, damaged, diverged, shared, changed, unwritable.
Each test is named after the issue's item it covers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp import checkpoint as ckpt
from tests.ddp import _launch

WORKER = str(Path(__file__).with_name("_signal_worker.py"))


def _state(step: int, value: float = 1.0) -> dict:
    return {"global_step": step, "model": {"w": torch.full((4,), value)}, "phase": 0}


class _Evil:
    """Unpickling this runs code: it creates the file named at construction."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _plant(directory: Path, step: int, obj: dict) -> Path:
    """A crafted checkpoint with a matching digest, as an attacker would leave it."""
    path = ckpt.step_path(directory, step)
    torch.save(obj, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(digest + "\n")
    return path


# ---- item 10: no code runs, the pointer stays inside -----------------------------------
def test_crafted_checkpoint_never_runs_code(tmp_path):
    marker = tmp_path / "pwned"
    ckpt.save_checkpoint(_state(1), tmp_path, 1)
    _plant(tmp_path, 2, {"format": 2, "global_step": 2, "evil": _Evil(marker)})
    (tmp_path / "latest").write_text("step_000000002.pt\n")
    path, state = ckpt.load_latest(tmp_path)  # skips the crafted one
    assert path.name == "step_000000001.pt" and state["global_step"] == 1
    from ddp.errors import ConfigError

    with pytest.raises(ConfigError, match="safe load refuses"):
        ckpt.load_checkpoint(ckpt.step_path(tmp_path, 2))
    assert not marker.exists()


def test_latest_pointer_cannot_leave_the_directory(tmp_path):
    outside = tmp_path / "elsewhere"
    ckpt.save_checkpoint(_state(7, 7.0), outside, 7)
    mine = tmp_path / "mine"
    ckpt.save_checkpoint(_state(1), mine, 1)
    for name in (str(ckpt.step_path(outside, 7)), "../elsewhere/step_000000007.pt"):
        (mine / "latest").write_text(name + "\n")
        assert ckpt.find_latest(mine) == ckpt.step_path(mine, 1)
        assert ckpt.load_latest(mine)[1]["global_step"] == 1
    os.symlink(ckpt.step_path(outside, 7), ckpt.step_path(mine, 9))  # a planted link
    assert ckpt.load_latest(mine)[1]["global_step"] == 1


def test_no_unsafe_torch_load_in_the_project():
    root = Path(__file__).resolve().parents[2]
    for package in ("src", "hpc"):
        for py in (root / package).rglob("*.py"):
            for line in py.read_text().splitlines():
                if "torch.load(" in line:
                    assert "weights_only=True" in line, f"{py}: {line.strip()}"


def test_trainer_state_loads_with_weights_only(tmp_path):
    import numpy  # noqa: F401 - the RNG state includes numpy's when it is installed

    state = {**_state(3), "rng": [ckpt.rng_state(torch.device("cpu"))]}
    ckpt.save_checkpoint(state, tmp_path, 3)
    loaded = ckpt.load_checkpoint(ckpt.step_path(tmp_path, 3))
    ckpt.set_rng_state(loaded["rng"][0], torch.device("cpu"))  # restores without error


# ---- item 9: a flipped byte is caught --------------------------------------------------
def test_flipped_byte_falls_back_to_the_previous_checkpoint(tmp_path):
    ckpt.save_checkpoint(_state(1, 1.0), tmp_path, 1, keep_last=5)
    path = ckpt.save_checkpoint(_state(2, 2.0), tmp_path, 2, keep_last=5)
    data = bytearray(path.read_bytes())
    pos = data.find(torch.full((4,), 2.0).numpy().tobytes())
    assert pos > 0
    data[pos + 1] ^= 0x40  # one bit of the tensor data: torch's reader does not notice
    path.write_bytes(bytes(data))
    found, state = ckpt.load_latest(tmp_path)
    assert found.name == "step_000000001.pt" and torch.equal(state["model"]["w"], torch.ones(4))
    from ddp.errors import ConfigError

    with pytest.raises(ConfigError, match="does not match its digest"):
        ckpt.load_checkpoint(path)


# ---- item 1: non-finite training -----------------------------------------------------
def _cfg(tmp_path: Path, **sections: dict) -> dict:
    cfg = {
        "training": {"epochs": 1, "batch_size": 4, "seed": 5},
        "optim": {"name": "sgd", "lr": 0.05},
        "logging": {"every_n_steps": 50, "progress": "plain"},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "keep_last": 1, "every_n_steps": 2},
        "ddp": {"timeout_s": 120},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def test_nan_loss_stops_without_saving_or_pruning_good_checkpoints(tmp_path):
    spec = {"config": _cfg(tmp_path), "n": 64, "nan_step": 5}
    results = _launch.run([WORKER, json.dumps(spec)], world=2, timeout=120)
    for rank, (code, _out, err) in enumerate(results):
        assert code == 2, f"rank {rank}: {code}\n{err[-2000:]}"
        assert "diverged" in err and "Traceback" not in err, err[-2000:]
    found, state = ckpt.load_latest(tmp_path / "ckpt")
    assert state["global_step"] == 4  # the last save before the NaN (step 6 refused)
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert not (tmp_path / "ckpt" / "final").exists()


@pytest.mark.parametrize("assignment", ["optim.grad_clip=nan", "optim.lr=inf", "optim.lr=.nan"])
def test_non_finite_config_values_refused(assignment):
    from ddp.config import TrainConfig
    from ddp.errors import ConfigError

    with pytest.raises(ConfigError, match="not a finite number"):
        TrainConfig().override([assignment])


# ---- item 2: one live run per checkpoint directory ------------------------------------
def test_second_run_on_a_live_checkpoint_dir_stops_naming_the_owner(tmp_path):
    lock = ckpt.DirLock.acquire(tmp_path / "ckpt")  # this test process is the live owner
    try:
        spec = {"config": _cfg(tmp_path), "n": 32}
        results = _launch.run([WORKER, json.dumps(spec)], world=2, timeout=120)
    finally:
        lock.release()
    for rank, (code, _out, err) in enumerate(results):
        assert code == 2, f"rank {rank}: {code}\n{err[-2000:]}"
        assert f"pid {os.getpid()}" in err and "in use by another run" in err
    assert ckpt.list_checkpoints(tmp_path / "ckpt") == []


def test_lock_of_a_dead_run_is_taken_over(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    info = {**ckpt.DirLock.owner(), "pid": int(dead), "job": None}
    (d / ckpt.LOCK).write_text(json.dumps(info))
    lock = ckpt.DirLock.acquire(d)
    assert json.loads((d / ckpt.LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (d / ckpt.LOCK).exists()


# ---- item 5: changed hyper-parameters on resume ----------------------------------------
def test_new_lr_on_resume_applies_and_is_logged(tmp_path):
    spec = {"config": _cfg(tmp_path, training={"max_steps": 4}), "n": 64}
    [(code, _o, err)] = _launch.run([WORKER, json.dumps(spec)], world=1, timeout=120)
    assert code == 0, err
    spec["config"] = _cfg(tmp_path, training={"max_steps": 6}, optim={"lr": 0.01})
    [(code, out, err)] = _launch.run([WORKER, json.dumps(spec)], world=1, timeout=120)
    assert code == 0, err
    assert "optim.lr changed 0.05 -> 0.01" in out + err
    _, state = ckpt.load_latest(tmp_path / "ckpt")
    assert state["global_step"] == 6
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.01)


# ---- item 18: unwritable, full, or another model ---------------------------------------
_TINY = str(Path(__file__).resolve().parents[2] / "configs" / "uniref50-tiny.yaml")


def _python_m_ddp(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp",
            "uniref50",
            "--config",
            _TINY,
            "--set",
            "training.max_steps=2",
            *sets,
        ],
        env=_launch.base_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


def _mount_tmpfs(path: Path, options: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)


def test_read_only_checkpoint_dir_reported_before_training(tmp_path):
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=1m")
    try:
        proc = _python_m_ddp(tmp_path, f"checkpoint.dir={ro / 'ck'}")
    finally:
        subprocess.run(["umount", str(ro)], check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "cannot write there" in proc.stderr
    assert "step 1 " not in proc.stdout  # stopped before the first step


def test_full_disk_is_one_line_and_keeps_older_checkpoints(tmp_path):
    full = tmp_path / "full"
    _mount_tmpfs(full, "size=200k")
    try:
        proc = _python_m_ddp(tmp_path, f"checkpoint.dir={full / 'ck'}")
        left = sorted(p.name for p in (full / "ck").iterdir())
    finally:
        subprocess.run(["umount", str(full)], check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "No space left on device" in proc.stderr and "Traceback" not in proc.stderr
    assert not [n for n in left if n.endswith(".tmp")], left


def test_checkpoint_of_another_model_is_one_line(tmp_path):
    assert _python_m_ddp(tmp_path, "checkpoint.dir=ck").returncode == 0
    proc = _python_m_ddp(tmp_path, "checkpoint.dir=ck", "model.d_model=32", "training.max_steps=4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "different model" in lines[0], proc.stderr


def test_changed_batch_size_on_resume_stops_with_one_line(tmp_path):
    assert _python_m_ddp(tmp_path, "checkpoint.dir=ck").returncode == 0
    proc = _python_m_ddp(
        tmp_path, "checkpoint.dir=ck", "training.batch_size=4", "training.max_steps=4"
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "training.batch_size" in lines[0], proc.stderr
