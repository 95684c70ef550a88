"""Device events for the forward's time (issue 31 item 1), read only at log points.

CPU has no timing events: the Trainer keeps its host timers (no event path). A mock GPU
(tests/ddp/_device_events_worker.py's FakeEvent, standing in for
``torch.cuda.Event(enable_timing=True)``) on 2 real Gloo ranks: the events are recorded
every micro-step and read only inside the log point, and the per-rank "compute" figure
is the mock device's forward time, so a rank slow on its device is named in "compute".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddp import stragglers
from tests.ddp import _launch

WORKER = str(_launch.ROOT / "tests/ddp/_device_events_worker.py")


def _run(tmp: Path, n: int, every: int, **extra: object) -> list[dict]:
    spec = json.dumps(
        {
            "config": {
                "training": {"batch_size": 4, "epochs": 1, "seed": 1},
                "optim": {"name": "sgd", "lr": 0.05},
                "checkpoint": {"dir": str(tmp / "ck")},
                "logging": {"every_n_steps": every, "progress": "off", "fingerprint": False},
            },
            "n": n,
            "out_dir": str(tmp),
            **extra,
        }
    )
    results = _launch.run([WORKER, spec], world=2, timeout=240)
    for rank, (rc, o, e) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{o[-2000:]}\n{e[-3000:]}"
    return [json.loads((tmp / f"events-rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("kind", ["cpu", "mps", "meta"])
def test_devices_without_timing_events_keep_host_timers(kind: str) -> None:
    assert stragglers.device_event_factory(torch.device(kind)) is None


def test_cuda_and_xpu_get_their_own_event_class() -> None:
    """The factory names torch's class for the device type; nothing is created here."""
    made = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            made.append(enable_timing)

    for kind, module in (("cuda", torch.cuda), ("xpu", getattr(torch, "xpu", None))):
        if module is None:
            continue
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module, "Event", Event)
            new = stragglers.device_event_factory(torch.device(kind))
            assert new is not None
            new()
    assert made and all(made)  # enable_timing=True every time


def test_on_cpu_the_trainer_takes_no_event_path(tmp_path: Path) -> None:
    for rec in _run(tmp_path, n=32, every=2):
        assert rec["event_path"] is False and rec["records"] == 0


def test_mock_gpu_events_are_read_only_at_log_points(tmp_path: Path) -> None:
    """8 steps, a log point every step: 24 events recorded per rank, none read between log
    points; at each log point one synchronize (on the last event) and the reads. Rank 1's
    mock device takes 0.5 s per forward against rank 0's 0.1 s: ranks.jsonl's compute
    column is exactly those figures, and rank 1 is the straggler in "compute"."""
    recs = _run(tmp_path, n=64, every=1, fake_events=True, forward_s=[0.1, 0.5], backward_s=0.2)
    for rec in recs:
        assert rec["event_path"] is True
        assert rec["records"] == 3 * 8  # 3 events a micro-step, 8 steps of 1 micro-step
        assert rec["reads_outside"] == 0
        assert rec["syncs"] == rec["log_points"] == 8
        assert rec["reads_inside"] == 8 * (1 + 2)  # a sync + forward and backward per step
    lines = [json.loads(x) for x in (tmp_path / "ck" / "ranks.jsonl").read_text().splitlines()]
    points = [x for x in lines if x["kind"] == "ranks"]
    assert [p["compute"] for p in points] == [[0.1, 0.5]] * 8
    assert all(p["sync"][r] >= 0.2 for p in points for r in (0, 1))
    (found,) = [x for x in lines if x["kind"] == "straggler"]
    assert (found["rank"], found["phase"]) == (1, "compute")
