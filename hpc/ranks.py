"""Per-rank timing in ``hpc report``: the rank x log point heat map and the stragglers.

The trainer's rank 0 writes ``ranks.jsonl`` beside ``metrics.jsonl`` (``ddp.stragglers``):
a ``hosts`` line, then per log point every rank's seconds per step in the data, compute
(forward) and sync phases, and a ``straggler`` line for each rank reported. Read as
untrusted text: a line that is not such a record is skipped and counted in a note (a
live run's last line may be half written), never a traceback.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc._util import json_number, open_regular, plot_text
from hpc.errors import UserError

RANKS = "ranks.jsonl"
PNG = "ranks.png"
MAX_LINE = 64 << 20  # a log point of 100,000 ranks is a few MB
MAX_POINTS = 100_000  # columns drawn (the latest); a note says when more were logged


@dataclass
class RankTimes:
    """One run's per-rank figures: ``grid[i][r]`` is rank r's data + compute seconds
    per step at log point ``steps[i]``."""

    path: Path
    hosts: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    grid: list[list[float]] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


#: The largest step read: past it a JSON integer is no step a run can reach (and no float).
MAX_STEP = 2**53


def _numbers(value: Any, n: int) -> list[float] | None:
    if not isinstance(value, list) or len(value) != n:
        return None
    out = []
    for v in value:
        number = json_number(v)
        if number is None:
            return None
        out.append(number)
    return out


def _step(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_STEP


def read(path: Path) -> RankTimes:
    """Parse ``ranks.jsonl`` (see the module docstring)."""
    out = RankTimes(path)
    with open_regular(path, "report") as fh:
        while raw := fh.readline(MAX_LINE + 1):
            try:
                rec = json.loads(raw.decode("utf-8")) if len(raw) <= MAX_LINE else None
            except (ValueError, RecursionError):
                rec = None
            if not isinstance(rec, dict):
                out.skipped += bool(raw.strip())
                continue
            kind = rec.get("kind")
            if kind == "hosts" and isinstance(rec.get("hosts"), list):
                out.hosts = [str(h) for h in rec["hosts"]]
            elif kind == "ranks" and _step(rec.get("step")) and out.hosts:
                data = _numbers(rec.get("data"), len(out.hosts))
                compute = _numbers(rec.get("compute"), len(out.hosts))
                if data is None or compute is None:
                    out.skipped += 1
                    continue
                out.steps.append(rec["step"])
                out.grid.append([a + b for a, b in zip(data, compute, strict=True)])
            elif kind == "straggler":
                out.stragglers.append(rec)
            else:
                out.skipped += 1
    if len(out.steps) > MAX_POINTS:
        out.steps, out.grid = out.steps[-MAX_POINTS:], out.grid[-MAX_POINTS:]
    return out


def notes(times: RankTimes, label: str) -> list[str]:
    """The persistent stragglers, one line each, and what was skipped."""
    lines = []
    for s in times.stragglers:
        sps, med = json_number(s.get("seconds_per_step")), json_number(s.get("median"))
        figures = (
            f": {sps:.4g} s/step against a median of {med:.4g}"
            if sps is not None and med is not None
            else ""
        )
        lines.append(
            f"{label}straggler: rank {s.get('rank')} on {s.get('host')} slow in "
            f"{s.get('phase')} from step {s.get('step')}{figures}"
        )
    if times.skipped:
        lines.append(f"{label}{times.path}: {times.skipped} line(s) skipped (not a record)")
    return lines


def heatmap(times: RankTimes, png: Path) -> bool:
    """Draw rank x log point (data + compute seconds per step) into ``png``; False when
    there is nothing to draw."""
    if not times.grid:
        return False
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "report: needs matplotlib; allowed: pip install 'hpc-ddp[report]' "
            "(or pip install matplotlib)"
        ) from None
    ranks = len(times.hosts)
    matrix = [
        [row[r] if math.isfinite(row[r]) else float("nan") for row in times.grid]
        for r in range(ranks)
    ]
    fig = Figure(
        figsize=(9, max(3.0, min(12.0, 1.5 + 0.25 * ranks))), dpi=100, layout="constrained"
    )
    ax = fig.subplots()
    image = ax.imshow(
        matrix,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        extent=(times.steps[0] - 0.5, times.steps[-1] + 0.5, ranks - 0.5, -0.5),
    )
    fig.colorbar(image, ax=ax, label="data + forward, s/step")
    ax.set_xlabel("step (log points)")
    ax.set_ylabel("rank")
    if ranks <= 32:
        names = [plot_text(f"{r} {h}") for r, h in enumerate(times.hosts)]
        ax.set_yticks(range(ranks), names, fontsize=7)
    for s in times.stragglers:
        if isinstance(s.get("rank"), int) and 0 <= s["rank"] < ranks:
            ax.axhline(s["rank"], color="red", lw=0.8, alpha=0.6)
    ax.set_title(
        "per-rank time before the gradient collective (red: reported stragglers)",
        loc="left",
        fontsize=10,
    )
    import io

    from hpc._util import write_atomic

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_atomic(png, buffer.getvalue(), "report: ranks heat map")
    return True
