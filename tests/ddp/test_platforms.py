"""Platforms as seeds 002/003 describe them: Gloo where NCCL is absent, one warning for
several processes on one Mac, and ``export NCCL_TIMEOUT=...`` honoured and logged."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from ddp import backends
from ddp.errors import ConfigError
from tests.ddp import _launch


@pytest.fixture
def cuda_without_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA-like device (Windows wheel, or CUDA built without NCCL): cuda is the first
    device, and torch.distributed answers is_nccl_available() False."""
    monkeypatch.setattr(backends, "available_devices", lambda: ["cuda", "cpu"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)


def test_auto_picks_gloo_where_nccl_is_absent(cuda_without_nccl, caplog) -> None:
    assert "nccl" not in backends.available_backends()  # the patch reached the real probe
    with caplog.at_level(logging.INFO, logger="ddp"):
        choice = backends.choose("auto", "auto", 1, 2)
    assert choice == backends.Choice(torch.device("cuda", 1), "gloo")
    said = [r.getMessage() for r in caplog.records if "NCCL is not available" in r.getMessage()]
    assert len(said) == 1 and "Gloo" in said[0], said


def test_explicit_nccl_without_nccl_is_one_line(cuda_without_nccl) -> None:
    with pytest.raises(ConfigError) as err:
        backends.choose("auto", "nccl", 0, 2)
    msg = str(err.value)
    assert "\n" not in msg and "backend='nccl' is not available" in msg and "gloo" in msg


def test_nccl_present_is_still_chosen_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "available_devices", lambda: ["cuda", "cpu"])
    monkeypatch.setattr(backends, "available_backends", lambda: ["nccl", "gloo"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert backends.choose("auto", "auto", 0, 1).backend == "nccl"


def test_several_processes_on_mps_warn_once_and_run(monkeypatch, caplog) -> None:
    monkeypatch.setattr(backends, "available_devices", lambda: ["mps", "cpu"])
    with caplog.at_level(logging.INFO, logger="ddp"):
        devices = [backends.choose("auto", "auto", r, 2).device for r in range(2)]
    assert devices == [torch.device("cpu")] * 2  # runs (Gloo on the CPU)
    said = [r.getMessage() for r in caplog.records if "no parallelism" in r.getMessage()]
    assert len(said) == 1, said  # local rank 0 only: once per Mac
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddp"):
        assert backends.choose("auto", "auto", 0, 1).device == torch.device("mps")
    assert not caplog.records  # one process on MPS: nothing to warn about


SHOW_TIMEOUT = "import ddp; c = ddp.init(); print('timeout_s', c.timeout_s)"


def _init_timeout(**env: str) -> subprocess.CompletedProcess[str]:
    full = _launch.base_env()
    for k in ("DDP_TIMEOUT", "NCCL_TIMEOUT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        full.pop(k, None)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", SHOW_TIMEOUT],
        env=full,
        text=True,
        capture_output=True,
        timeout=120,
        cwd=_launch.ROOT,
    )


def test_nccl_timeout_is_read_in_seconds_and_logged() -> None:
    r = _init_timeout(NCCL_TIMEOUT="7200")
    assert r.returncode == 0, r.stderr
    assert "timeout_s 7200.0" in r.stdout
    assert "collective timeout: 7200 s (NCCL_TIMEOUT)" in r.stdout
    # DDP_TIMEOUT, the project's own name, wins over the seeds' variable
    r = _init_timeout(NCCL_TIMEOUT="7200", DDP_TIMEOUT="600")
    assert "timeout_s 600.0" in r.stdout and "(DDP_TIMEOUT)" in r.stdout, r.stdout
    r = _init_timeout()
    assert "collective timeout: 1800 s (default)" in r.stdout, r.stdout


def test_bad_nccl_timeout_is_one_line() -> None:
    r = _init_timeout(NCCL_TIMEOUT="30min")
    assert r.returncode == 2
    assert r.stderr.strip() == "ddp: error: NCCL_TIMEOUT='30min' is not a number of seconds"


def test_config_timeout_wins_over_nccl_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddp.dist import _timeout_and_source

    monkeypatch.setenv("NCCL_TIMEOUT", "7200")
    monkeypatch.delenv("DDP_TIMEOUT", raising=False)
    assert _timeout_and_source(None)[0].total_seconds() == 7200
    limit, source = _timeout_and_source(300.0)  # ddp.timeout_s given
    assert limit.total_seconds() == 300 and "ddp.timeout_s" in source
