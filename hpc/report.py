"""``hpc report RUN_DIR...``: plot and summarize what runs wrote to ``metrics.jsonl``.

The trainer writes one JSON line per log point (``"kind": "train"``: loss, lr,
samples_per_s, ...) and per evaluation (``"kind": "eval"``), flushed at once, so a
running job's file can be read; its last line may then be half written. This module
reads those files as untrusted text (a crafted or binary file is one line naming it,
never a traceback), draws loss, eval loss, learning rate and throughput against step
into one PNG (several runs or sweep tasks overlaid, one colour each) and prints a
summary table. Finding and reading the files is :mod:`hpc.report_read` (re-exported).

matplotlib and rich are imported inside the functions that use them: ``import hpc``
stays fast, and matplotlib is needed only by this command (the ``report`` extra).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc._util import plot_text, printable
from hpc.errors import UserError
from hpc.report_read import (
    MAX_LINE,
    Series,
    find_metrics,
    read_metrics,
)
from hpc_ddp.run_layout import METRICS

__all__ = [
    "MAX_LEGEND",
    "MAX_LINE",
    "METRICS",
    "PLOT_LIMIT",
    "PNG",
    "ReportResult",
    "RunSummary",
    "Series",
    "find_metrics",
    "plot",
    "read_metrics",
    "report",
    "summarize",
    "summary_table",
]

PNG = "report.png"
#: What ``--output`` may replace: an earlier plot, never a run's ``run.json`` or
#: ``metrics.jsonl`` or a note that happened to be named there (checked by its magic).
PNG_FILE = ("a PNG image", lambda head: head.startswith(b"\x89PNG\r\n\x1a\n"))
MAX_LEGEND = 20
"""More series than this are drawn without a legend (a 1000-task sweep's would cover
the plot); the summary table still names every one."""


@dataclass
class RunSummary:
    """One row of the summary table; None where the metric was never logged.

    ``wall_time_s`` is first to last logged time, so for a resumed run it includes the
    time between its jobs (queue waits).
    """

    label: str
    path: Path
    steps: int | None
    last_loss: float | None
    best_eval_loss: float | None
    last_lr: float | None
    mean_samples_per_s: float | None
    wall_time_s: float | None


@dataclass
class ReportResult:
    """What :func:`report` drew: the PNG, and per series its data and summary."""

    png: Path
    series: list[Series]
    runs: list[RunSummary]
    notes: list[str] = field(default_factory=list)
    """What the plot leaves out, one line each (points not drawn: see :func:`_drawable`)."""

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.series]


# ---- summaries --------------------------------------------------------------------------


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def summarize(series: Series) -> RunSummary:
    """One table row: last values as logged (NaN shows as nan), best and mean over finite."""
    losses, lrs = series.values("loss"), series.values("lr")
    steps = [s for points in series.train.values() for s, _ in points]
    steps += [s for s, _ in series.eval_loss]
    evals = _finite([v for _, v in series.eval_loss])
    speeds = _finite(series.values("samples_per_s"))
    span = max(series.times) - min(series.times) if len(series.times) > 1 else None
    return RunSummary(
        label=series.label,
        path=series.path,
        steps=max(steps) if steps else None,
        last_loss=losses[-1] if losses else None,
        best_eval_loss=min(evals) if evals else None,
        last_lr=lrs[-1] if lrs else None,
        mean_samples_per_s=sum(speeds) / len(speeds) if speeds else None,
        wall_time_s=span if span is not None and math.isfinite(span) else None,  # 1e308 - -1e308
    )


def summary_table(rows: list[RunSummary]) -> Any:
    """The summary as a ``rich.table.Table``.

    Every cell is a ``rich.text.Text``, never a markup string: a label is a run's folder
    name or a sweep's ``KEY=VALUE``, and ``[/x]`` or ``[bold]`` in it is the user's text,
    not markup (rich would raise ``MarkupError`` on the first, restyle on the second).
    """
    from rich.table import Table
    from rich.text import Text

    table = Table(title="runs")
    for name in (
        "run",
        "steps",
        "last loss",
        "best eval loss",
        "last lr",
        "samples/s",
        "wall time",
    ):
        table.add_column(name, justify="left" if name == "run" else "right")
    for r in rows:
        cells = (
            r.label,
            _fmt(r.steps, "d"),
            _fmt(r.last_loss, ".4g"),
            _fmt(r.best_eval_loss, ".4g"),
            _fmt(r.last_lr, ".3g"),
            _fmt(r.mean_samples_per_s, ".1f"),
            _duration(r.wall_time_s),
        )
        table.add_row(*(Text(c) for c in cells))
    return table


def _fmt(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# ---- the figure -------------------------------------------------------------------------


def _colors(n: int) -> list[str]:
    from matplotlib import colormaps, colors

    if n <= 10:
        return [colors.to_hex(f"C{i}") for i in range(n)]
    cmap = colormaps["viridis"]
    return [colors.to_hex(cmap(i / max(1, n - 1))) for i in range(n)]


PLOT_LIMIT = 1e100
"""Largest magnitude drawn. Past it a value is divergence, not a curve, and matplotlib's
axis arithmetic overflows near float's range (two points at 1e308 raise ``ValueError:
arange: cannot compute length``); such points, and NaN/inf, are gaps with a note."""


def _drawable(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= PLOT_LIMIT


def _xy(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """Steps and values with what cannot be drawn as NaN: a gap in the line, not a
    blown-up axis or a traceback (see :data:`PLOT_LIMIT`)."""
    return [s for s, _ in points], [v if _drawable(v) else math.nan for _, v in points]


def _left_out(series: list[Series]) -> list[str]:
    """One note per series and metric with points :func:`_xy` leaves out."""
    notes = []
    for s in series:
        metrics = [(name, s.train.get(name, [])) for name in ("loss", "lr", "samples_per_s")]
        for name, points in [*metrics, ("eval loss", s.eval_loss)]:
            bad = [v for _, v in points if not _drawable(v)]
            if bad:
                kinds = sorted(
                    {
                        "NaN"
                        if math.isnan(v)
                        else "inf"
                        if math.isinf(v)
                        else f"beyond ±{PLOT_LIMIT:g}"
                        for v in bad
                    }
                )
                notes.append(
                    f"{s.label}: {len(bad)} of {len(points)} {name} points not drawn "
                    f"({', '.join(kinds)})"
                )
    return notes


def plot(series: list[Series], png: Path) -> None:
    """Draw the panels into ``png`` (written whole by :func:`hpc._util.write_atomic`:
    the mode of the run's other files, and never over anything but a regular file)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no display, no global state (Agg)
    except ImportError:
        raise UserError(
            "report: needs matplotlib; allowed: pip install 'hpc-ddp[report]' "
            "(or pip install matplotlib)"
        ) from None

    fig = Figure(figsize=(9, 10), dpi=100, layout="constrained")
    loss_ax, lr_ax, speed_ax = fig.subplots(3, 1, sharex=True)
    for s, color in zip(series, _colors(len(series)), strict=True):
        s.color = color
        name = plot_text(s.label)
        if s.train.get("loss"):
            loss_ax.plot(*_xy(s.train["loss"]), color=color, lw=1.5, label=name)
        if s.eval_loss:
            loss_ax.plot(
                *_xy(s.eval_loss),
                color=color,
                lw=1.5,
                ls="--",
                marker="o",
                ms=3,
                label=f"{name} (eval)",
            )
        if s.train.get("lr"):
            lr_ax.plot(*_xy(s.train["lr"]), color=color, lw=1.5, label=name)
        if s.train.get("samples_per_s"):
            speed_ax.plot(*_xy(s.train["samples_per_s"]), color=color, lw=1.5, label=name)
    for ax, title in (
        (loss_ax, "loss (solid: train, dashed: eval)"),
        (lr_ax, "learning rate"),
        (speed_ax, "samples/s"),
    ):
        ax.set_title(title, loc="left", fontsize=10)
        ax.grid(True, alpha=0.3)
    speed_ax.set_xlabel("step")
    if len(series) <= MAX_LEGEND and loss_ax.get_legend_handles_labels()[0]:
        loss_ax.legend(fontsize=8, loc="best")
    import io

    from hpc._util import write_atomic

    buffer = io.BytesIO()  # a few hundred kB: drawn first, so a failure writes nothing
    fig.savefig(buffer, format="png")
    write_atomic(png, buffer.getvalue(), "report: --output", owner=PNG_FILE)


# ---- the command ------------------------------------------------------------------------


def report(run_dirs: list[Path], out: Path | None = None, console: Any = None) -> ReportResult:
    """Read every run's metrics, draw ``report.png`` and return what was drawn.

    ``out``: the PNG (a folder gets ``report.png`` in it); default ``report.png`` in the
    first run directory. ``console``: a ``rich.console.Console`` to print the summary
    table to (None: no table). Problems for the user are one-line ``UserError``s.
    """
    if not run_dirs:
        raise UserError("report: no run directory; allowed: one or more run directories")
    try:
        found = _find_all(run_dirs)
        png = _png_path(Path(run_dirs[0]), out)
    except OSError as exc:  # a path too long for the file system, a folder not searchable
        raise UserError(
            f"report: {str(exc.filename)!r}: {exc.strerror}; allowed: run "
            "directories and a PNG path that exist"
        ) from None
    if not found:
        names = ", ".join(repr(str(d)) for d in run_dirs)
        raise UserError(
            f"report: no {METRICS} in {names} (nor in its task or checkpoint "
            "folders); allowed: a run that has logged at least once"
        )
    series = [read_metrics(path, label) for label, path in _unique(found)]
    if not any(s.train or s.eval_loss for s in series):
        raise UserError(
            f"report: no metrics logged yet in {', '.join(str(s.path) for s in series)}"
        )
    try:
        plot(series, png)
    except OSError as exc:
        raise UserError(f"report: cannot write {str(png)!r}: {exc.strerror}") from None
    rows = [summarize(s) for s in series]
    notes = _left_out(series) + _per_rank(_unique(found))
    if console is not None:
        from rich.text import Text

        console.print(summary_table(rows))
        for line in notes:  # paths and labels are the user's text: Text, never markup
            console.print(Text(printable(f"note: {line}")))
        console.print(Text(printable(f"plot: {png}")))
    return ReportResult(png=png, series=series, runs=rows, notes=notes)


def _per_rank(found: list[tuple[str, Path]]) -> list[str]:
    """Each run's per-rank heat map (``ranks.png`` beside its ``ranks.jsonl``) and its
    stragglers, as notes (see :mod:`hpc.ranks`)."""
    from hpc import ranks

    notes: list[str] = []
    for label, path in found:
        source = path.parent / ranks.RANKS
        if not source.is_file():
            continue
        times = ranks.read(source)
        prefix = f"{label}: " if label else ""
        notes += ranks.notes(times, prefix)
        png = path.parent / ranks.PNG
        try:
            if ranks.heatmap(times, png):
                notes.append(f"{prefix}per-rank heat map: {png}")
        except OSError as exc:
            raise UserError(f"report: cannot write {str(png)!r}: {exc.strerror}") from None
    return notes


def _find_all(run_dirs: list[Path]) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for run_dir in run_dirs:
        prefix = (
            f"{Path(run_dir).resolve().name} " if len(run_dirs) > 1 and run_dir.is_dir() else ""
        )
        found += find_metrics(Path(run_dir), prefix)
    return found


def _unique(found: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """Labels made unique (two runs of one name in different folders), same file once,
    and printable (a folder's or a sweep.json's text: see :func:`hpc._util.printable`)."""
    seen_paths: set[Path] = set()
    counts: dict[str, int] = {}
    result = []
    for raw, path in found:
        if path.resolve() in seen_paths:
            continue
        seen_paths.add(path.resolve())
        label = printable(raw)
        counts[label] = counts.get(label, 0) + 1
        result.append((label if counts[label] == 1 else f"{label} ({counts[label]})", path))
    return result


def _png_path(first: Path, out: Path | None) -> Path:
    if out is None:
        return (first.parent if first.is_file() else first) / PNG
    if out.is_dir():
        return out / PNG
    if not out.parent.is_dir():
        raise UserError(
            f"report: folder {str(out.parent)!r} does not exist; "
            "allowed: a PNG path in an existing folder"
        )
    return out
