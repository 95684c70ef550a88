"""One rank of tests/ddp/_train_worker.py's run with a mock GPU's timing events.

The rank's device is the CPU (Gloo), so the Trainer would take the host-timer path; with
spec ``fake_events: true`` ``ddp.stragglers.device_event_factory`` is replaced by a maker
of :class:`FakeEvent`, a documented stand-in for ``torch.cuda.Event(enable_timing=True)``:
``record()`` stamps the event with a fake device clock that advances, per micro-step, by
``forward_s`` (this rank's entry) after the first event, ``backward_s`` after the second and
1 ms after the third, as a GPU's stream would between the three events the Trainer
records; ``elapsed_time(other)`` is the difference in milliseconds; ``synchronize()`` and
``query()`` count as host waits. Every read (elapsed_time, synchronize, query) notes
whether it happened inside ``Trainer._log_point``. Results (counts, and whether the
Trainer took the event path) go to ``<out_dir>/events-rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.ddp import _train_worker

STATE = {
    "in_log_point": False,
    "log_points": 0,
    "records": 0,
    "reads_inside": 0,
    "reads_outside": 0,
    "syncs": 0,
    "event_path": None,
}


class FakeEvent:
    """A mock GPU timing event (see the module docstring)."""

    clock_s = 0.0
    steps: list[float] = []

    def record(self) -> None:
        STATE["records"] += 1
        self.t = FakeEvent.clock_s
        FakeEvent.clock_s += FakeEvent.steps[(STATE["records"] - 1) % 3]

    def _read(self) -> None:
        STATE["reads_inside" if STATE["in_log_point"] else "reads_outside"] += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        self._read()
        return (end.t - self.t) * 1000.0

    def synchronize(self) -> None:
        self._read()
        STATE["syncs"] += 1

    def query(self) -> bool:
        self._read()
        return True


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    from ddp import stragglers
    from ddp.trainer import Trainer

    if spec.get("fake_events"):
        FakeEvent.steps = [spec["forward_s"][rank], spec["backward_s"], 0.001]
        stragglers.device_event_factory = lambda device: FakeEvent  # type: ignore[assignment]

    original_log_point = Trainer._log_point
    original_open = Trainer._open_stragglers

    def log_point(self: Trainer, *args: object, **kwargs: object) -> None:
        STATE["in_log_point"] = True
        STATE["log_points"] += 1
        try:
            original_log_point(self, *args, **kwargs)
        finally:
            STATE["in_log_point"] = False

    def open_stragglers(self: Trainer) -> None:
        original_open(self)
        STATE["event_path"] = self._device_times is not None

    Trainer._log_point = log_point  # type: ignore[method-assign]
    Trainer._open_stragglers = open_stragglers  # type: ignore[method-assign]
    try:
        _train_worker.main()
    finally:
        out = Path(spec["out_dir"]) / f"events-rank{rank}.json"
        out.write_text(json.dumps(STATE))


if __name__ == "__main__":
    main()
