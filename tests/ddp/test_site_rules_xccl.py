"""pytorch#156782 on the compute side: XCCL Send/Recv hang on torch 2.8 unless
CCL_SEND=direct CCL_RECV=direct; only the node knows its torch, so ddp.dist sets them
before the process group is made, at 2.8.x on XPU only (fixed in 2.9)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from ddp import backends, dist
from ddp.env import DistEnv


@pytest.mark.parametrize(
    ("device", "version", "fixed"),
    [
        ("xpu", "2.8.0", True),
        ("xpu", "2.8.1+xpu", True),
        ("xpu", "2.8.0a0+gitabc", True),
        ("xpu", "2.9.0", False),
        ("xpu", "2.7.1+xpu", False),
        ("xpu", "2.10.0", False),
        ("cuda", "2.8.0", False),
        ("cpu", "2.8.0", False),
    ],
)
def test_the_fix_switches_at_torch_2_8_on_xpu(device: str, version: str, fixed: bool) -> None:
    got = dist.xccl_p2p_env(device, version, {})
    assert got == ({"CCL_SEND": "direct", "CCL_RECV": "direct"} if fixed else {})


def test_a_value_the_user_set_wins() -> None:
    assert dist.xccl_p2p_env("xpu", "2.8.0", {"CCL_SEND": "epoll"}) == {"CCL_RECV": "direct"}


def test_init_sets_it_before_the_process_group_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ddp.dist's own init with two seams: the device choice (an xpu device on a
    CPU machine) and _set_device (no XPU runtime here)."""
    monkeypatch.setattr(dist, "_CONTEXT", None)
    monkeypatch.setattr(
        backends, "choose", lambda *a: backends.Choice(torch.device("xpu", 0), "gloo")
    )
    monkeypatch.setattr(dist, "_set_device", lambda device: None)
    monkeypatch.setattr(torch, "__version__", "2.8.1+xpu")
    for key in ("CCL_SEND", "CCL_RECV"):  # set, then removed: undone after the test
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    monkeypatch.delenv("DDP_RANK_LOGS", raising=False)
    one = DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        launcher="none",
    )
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    dist.log.addHandler(handler)
    monkeypatch.setattr(dist.log, "level", logging.INFO)
    try:
        ctx = dist.init(env=one, exit_on_error=False)
        assert ctx.device == torch.device("xpu", 0)
        assert os.environ["CCL_SEND"] == "direct" and os.environ["CCL_RECV"] == "direct"
        said = [ln for ln in seen if "pytorch#156782" in ln]
        assert len(said) == 1 and "CCL_SEND=direct CCL_RECV=direct" in said[0]
    finally:
        dist.log.removeHandler(handler)
        monkeypatch.setattr(dist, "_CONTEXT", None)
