"""Which rank is slow, and in what: per-rank phase times and the straggler report.

Why per phase: DDP's gradient all-reduce equalises the backward pass on every rank (the
fast ranks wait inside it for the slow one), so a slow rank cannot be seen in the step
time, which is the same everywhere. What differs is what each rank does before the
first collective of the step: waiting for its data and running its forward pass. Each
rank times those with host timers (``time.perf_counter``: no device sync, so on an
asynchronous device the forward time is the host's view of it: launch plus any wait),
plus the rest of the step (backward, the collective, the optimizer) as ``sync``. Where
the device has timing events (:class:`DeviceTimes`), the forward and the backward are
also timed on the device, read at log points only, and replace the host's view. One
exception: DDP's second step rebuilds its gradient buckets with a broadcast inside the
forward, so that one log point's forward times include a wait (a streak needs more).

The figures ride on the log point's existing all-reduce (one slot per rank and phase,
zeros elsewhere: the sum is every rank's own value), so no collective is added. Rank 0
keeps ``ranks.jsonl`` beside ``metrics.jsonl`` (the hosts once, then one line per log
point with every rank's seconds per step) for ``hpc report``'s heat map, and reports a
rank once when its data or forward time has been over ``factor`` x the median, and at
least ``min_s`` a step above it, at ``points`` log points in a row.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("ddp")

PHASES = ("data", "compute", "sync")
#: The phases a straggler is judged on (``sync`` is equalised by the all-reduce).
JUDGED = ("data", "compute")


@dataclass
class Stragglers:
    """Rank 0's view across log points (other ranks only contribute their slots)."""

    world: int
    hosts: list[str]
    factor: float = 1.5
    points: int = 3
    min_s: float = 0.005
    path: Path | None = None
    streak: dict[tuple[int, str], int] = field(default_factory=dict)
    reported: set[tuple[int, str]] = field(default_factory=set)
    found: list[dict[str, Any]] = field(default_factory=list)
    _fh: Any = None

    def open(self) -> None:
        """Start ``ranks.jsonl`` with the hosts (appended to on a resume)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._write({"kind": "hosts", "hosts": self.hosts})

    def _write(self, rec: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(rec) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def update(self, step: int, per_rank: list[list[float]]) -> dict[str, float]:
        """``per_rank[r]``: rank r's seconds per step in each of :data:`PHASES` since
        the last log point. Returns the scalars for metrics.jsonl."""
        out: dict[str, float] = {}
        self._write(
            {
                "kind": "ranks",
                "step": step,
                **{p: [round(t[i], 6) for t in per_rank] for i, p in enumerate(PHASES)},
            }
        )
        for i, phase in enumerate(PHASES):
            col = [t[i] for t in per_rank]
            med = statistics.median(col)
            out[f"rank_{phase}_s_min"], out[f"rank_{phase}_s_median"] = min(col), med
            out[f"rank_{phase}_s_max"] = max(col)
            if phase not in JUDGED:
                continue
            for rank, value in enumerate(col):
                key = (rank, phase)
                slow = value > self.factor * med and value - med > self.min_s
                self.streak[key] = self.streak.get(key, 0) + 1 if slow else 0
                if self.streak[key] >= self.points and key not in self.reported:
                    self.reported.add(key)
                    self._report(step, rank, phase, value, med)
        judged = [sum(t[PHASES.index(p)] for p in JUDGED) for t in per_rank]
        out["slowest_rank"] = float(max(range(len(judged)), key=judged.__getitem__))
        return out

    def _report(self, step: int, rank: int, phase: str, value: float, med: float) -> None:
        host = self.hosts[rank] if rank < len(self.hosts) else "?"
        rec = {
            "kind": "straggler",
            "step": step,
            "rank": rank,
            "host": host,
            "phase": phase,
            "seconds_per_step": round(value, 6),
            "median": round(med, 6),
            "points": self.points,
        }
        self.found.append(rec)
        self._write(rec)
        log.warning(
            "straggler: rank %d on %s is slow in %s: %.4f s/step against a median "
            "of %.4f, %d log points in a row (step %d)",
            rank,
            host,
            phase,
            value,
            med,
            self.points,
            step,
        )


def slots(world: int, rank: int, times: list[float]) -> list[float]:
    """This rank's contribution to the log point's all-reduce: its times in its slots."""
    out = [0.0] * (world * len(PHASES))
    out[rank * len(PHASES) : (rank + 1) * len(PHASES)] = times
    return out


def unpack(summed: list[float], world: int) -> list[list[float]]:
    """The all-reduced slots (a sum, or a mean times ``world``) as per-rank rows."""
    n = len(PHASES)
    return [summed[r * n : (r + 1) * n] for r in range(world)]


# --- device events (issue 31 item 1): the forward's time on the device itself ----------


def device_event_factory(device: Any) -> Callable[[], Any] | None:
    """A maker of timing events for ``device``'s type; None where it has none (CPU, MPS).

    CUDA (ROCm too: torch exposes it as ``cuda``) and Intel XPU have events that
    ``record()`` a timestamp on the current stream without making the host wait;
    ``torch.cuda.Event(enable_timing=True)`` / ``torch.xpu.Event(enable_timing=True)``.
    """
    import torch

    kind = getattr(device, "type", str(device))
    module = {"cuda": getattr(torch, "cuda", None), "xpu": getattr(torch, "xpu", None)}.get(kind)
    event = getattr(module, "Event", None) if module is not None else None
    if event is None:
        return None
    return lambda: event(enable_timing=True)


class DeviceTimes:
    """Each micro-step's forward and backward timed on the device, read at log points.

    Why: on an asynchronous device the host timers see the forward's launch, not its
    run, so the host's "compute" figure says little about a slow GPU. Three events per
    micro-step (before the forward, after it, after the backward) are recorded on the
    stream: recording never waits. ``elapsed_time`` needs completed events, so they are
    read only in :meth:`phases`, at a log point, after one ``synchronize`` on the last
    event: the log point's collective and its ``tolist()`` wait for the device there
    anyway, so no host sync is added between log points (tests/ddp/test_trainer_sync.py).

    The forward on the device is the "compute" phase (the one DDP does not equalise).
    The backward's device time, which includes DDP's wait for the gradient all-reduce at
    its end, replaces the host's view of the backward inside "sync".
    """

    def __init__(self, new_event: Callable[[], Any], clock: Callable[[], float]) -> None:
        self._new, self._clock = new_event, clock
        self._steps: list[tuple[Any, Any, Any, float]] = []  # events + host backward s
        self._open: list[Any] = []
        self._host: list[float] = []

    def mark(self) -> None:
        """Record an event now: before the forward, after it, after the backward."""
        ev = self._new()
        ev.record()
        self._open.append(ev)
        self._host.append(self._clock())
        if len(self._open) == 3:
            start, mid, end = self._open
            self._steps.append((start, mid, end, self._host[2] - self._host[1]))
            self._open, self._host = [], []

    def phases(self, times: list[float]) -> list[float]:
        """``times`` (data, compute, sync host seconds since the last log point) with
        compute := the device's forward seconds and the host's backward in sync replaced
        by the device's. Reads (and forgets) the events recorded since the last call."""
        if not self._steps:
            return list(times)
        self._steps[-1][2].synchronize()  # the log point waits for the device anyway
        fwd = sum(s.elapsed_time(m) for s, m, _, _ in self._steps) / 1000.0  # ms -> s
        bwd = sum(m.elapsed_time(e) for _, m, e, _ in self._steps) / 1000.0
        host_bwd = sum(h for *_, h in self._steps)
        self._steps = []
        return [times[0], fwd, max(0.0, times[2] - host_bwd) + bwd]
