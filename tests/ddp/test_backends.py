"""Device and backend choice, with availability patched (this machine has only the CPU)."""

from __future__ import annotations

import pytest
import torch

from ddp import backends
from ddp.errors import ConfigError


@pytest.fixture
def avail(monkeypatch):
    """Set what this process pretends to have: avail(devices=[...], backends=[...], count=N)."""

    def set_(devices=("cpu",), backends_=("gloo",), count=4):
        monkeypatch.setattr(backends, "available_devices", lambda: list(devices))
        monkeypatch.setattr(backends, "available_backends", lambda: list(backends_))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        if hasattr(torch, "xpu"):
            monkeypatch.setattr(torch.xpu, "device_count", lambda: count)

    return set_


def test_auto_prefers_cuda_then_xpu_then_mps(avail):
    avail(["cuda", "xpu", "cpu"], ["nccl", "gloo"])
    assert backends.choose("auto", "auto", 1, 2) == backends.Choice(torch.device("cuda", 1), "nccl")
    avail(["xpu", "cpu"], ["gloo", "xccl", "ccl"])
    assert backends.choose("auto", "auto", 5, 12) == backends.Choice(torch.device("xpu", 1), "xccl")
    avail(["mps", "cpu"], ["gloo"])
    assert backends.choose("auto", "auto", 0, 1) == backends.Choice(torch.device("mps"), "gloo")
    avail(["cpu"], ["gloo"])
    assert backends.choose("auto", "auto", 0, 1) == backends.Choice(torch.device("cpu"), "gloo")


def test_xpu_falls_back_to_oneccl_bindings(avail):
    avail(["xpu", "cpu"], ["gloo", "ccl"])
    assert backends.choose("xpu", "xpu", 0, 2).backend == "ccl"
    avail(["xpu", "cpu"], ["gloo"])
    with pytest.raises(ConfigError, match="available: gloo"):
        backends.choose("xpu", "auto", 0, 2)


def test_masked_devices_give_index_zero(avail):
    avail(["cuda", "cpu"], ["nccl", "gloo"], count=1)  # CUDA_VISIBLE_DEVICES=<one>
    assert backends.choose("auto", "auto", 3, 4).device == torch.device("cuda", 0)


def test_unavailable_backend_lists_what_is(avail):
    avail(["cpu"], ["gloo", "mpi"])
    with pytest.raises(ConfigError, match=r"backend='nccl' is not available.*available: gloo, mpi"):
        backends.choose("cpu", "nccl", 0, 2)
    with pytest.raises(ConfigError, match="allowed: auto, nccl"):
        backends.choose("cpu", "bogus", 0, 2)
    with pytest.raises(ConfigError, match="device='cuda' is not available"):
        backends.choose("cuda", "auto", 0, 2)


def test_several_processes_on_mps(avail):
    avail(["mps", "cpu"], ["gloo"])
    # auto: fall back to the CPU with a warning, the job still runs
    assert backends.choose("auto", "auto", 0, 2).device == torch.device("cpu")
    # explicit mps with several ranks: stop early, clearly
    with pytest.raises(ConfigError, match="Gloo cannot carry MPS tensors"):
        backends.choose("mps", "auto", 0, 2)


def test_real_cpu_machine():
    # No patching: what this CPU-only torch build really offers.
    assert "gloo" in backends.available_backends()
    assert backends.available_devices()[-1] == "cpu"
    assert backends.choose("cpu", "auto", 0, 2) == backends.Choice(torch.device("cpu"), "gloo")
