"""``hpc report``'s input: finding a run's ``metrics.jsonl`` files and reading each one.

The files are untrusted text (a live run's last line may be half written; a crafted or
binary file is one line naming it, never a traceback); :mod:`hpc.report` summarizes
and plots the :class:`Series` read here, and re-exports these names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc._util import json_number, open_regular
from hpc.errors import UserError
from hpc_ddp.run_layout import METRICS, metrics_paths

MAX_LINE = 1 << 20
"""Longest line read (a real one is a few hundred bytes)."""
_EVAL_LOSS_KEYS = ("loss", "eval_loss", "val_loss")


@dataclass
class Series:
    """One run's (or sweep task's) metrics, sorted by step, one point per step."""

    label: str
    path: Path
    train: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """metric name -> [(step, value)] from the train lines (loss, lr, samples_per_s, ...)."""
    eval_loss: list[tuple[int, float]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    color: str = ""
    """The colour its lines were drawn in (hex), set by :func:`hpc.report.report`."""

    def values(self, name: str) -> list[float]:
        return [v for _, v in self.train.get(name, [])]


# ---- finding metrics files --------------------------------------------------------------


def find_metrics(run_dir: Path, prefix: str = "") -> list[tuple[str, Path]]:
    """``(label, metrics.jsonl)`` pairs of one run directory, in a stable order.

    A sweep's tasks are found through its ``sweep.json`` and labelled with their
    overrides (tasks that have not started yet have no file and are left out);
    otherwise the run's own file, else files one or two folders down (task folders,
    ``checkpoints/``), labelled with their folder. A path to a ``.jsonl`` file is
    taken as it is.
    """
    if run_dir.is_file():
        return [(prefix + run_dir.resolve().parent.name, run_dir)]
    if not run_dir.is_dir():
        raise UserError(f"report: {str(run_dir)!r} is not a run directory or metrics file")
    from hpc import sweep

    if (run_dir / sweep.MANIFEST).is_file():
        found = []
        for task in sweep.read_manifest(run_dir):
            task_dir = sweep.task_dir(run_dir, task)
            for path in metrics_paths(task_dir):
                if path.is_file():
                    found.append((prefix + task.label, path))
                    break
        return found
    if (run_dir / METRICS).is_file():
        return [(prefix.rstrip() or run_dir.resolve().name, run_dir / METRICS)]
    paths = sorted(run_dir.glob(f"*/{METRICS}")) or sorted(run_dir.glob(f"*/*/{METRICS}"))
    return [(prefix + str(p.parent.relative_to(run_dir)), p) for p in paths if p.is_file()]


# ---- reading one file -------------------------------------------------------------------


def read_metrics(path: Path, label: str) -> Series:
    """Parse one ``metrics.jsonl``.

    Tolerated, because a live or resumed run writes them: blank lines, a half-written
    last line, records without some keys (skipped per key), NaN/inf values, a step
    logged twice (the last wins). Refused with one line naming the file: text that is
    not UTF-8 or holds NUL bytes, an unreadable line before the last, a line that is
    not a JSON object, a line past :data:`MAX_LINE` bytes.
    """
    train: dict[str, dict[int, float]] = {}
    evals: dict[int, float] = {}
    times: list[float] = []
    where = f"report: {str(path)!r}"
    with open_regular(path, "report") as fh:  # a FIFO or device there: one line, not a hang
        lines = _lines(fh, where)
        bad: tuple[int, str] | None = None  # a bad line is fatal only if another follows
        for number, raw in lines:
            if b"\0" in raw:
                raise UserError(
                    f"{where} line {number}: holds NUL bytes (a binary file?); "
                    "allowed: a metrics.jsonl the trainer wrote"
                )
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"{where} line {number}: not UTF-8 text (byte {exc.start}); "
                    "allowed: a metrics.jsonl the trainer wrote"
                ) from None
            if not text.strip():
                continue
            if bad is not None:
                raise UserError(
                    f"{where} line {bad[0]}: {bad[1]}; allowed: a metrics.jsonl "
                    "the trainer wrote (one JSON object a line)"
                )
            try:
                rec = json.loads(text)
            except (ValueError, RecursionError):
                bad = (number, "not JSON")
                continue
            if not isinstance(rec, dict):
                raise UserError(
                    f"{where} line {number}: a JSON {type(rec).__name__}, not an "
                    "object; allowed: a metrics.jsonl the trainer wrote"
                )
            _add(rec, train, evals, times)
    return Series(
        label=label,
        path=path,
        train={k: sorted(v.items()) for k, v in train.items()},
        eval_loss=sorted(evals.items()),
        times=times,
    )


def _lines(fh: Any, where: str) -> Any:
    number = 0
    while True:
        raw = fh.readline(MAX_LINE + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE:
            raise UserError(
                f"{where} line {number}: longer than {MAX_LINE} bytes; "
                "allowed: a metrics.jsonl the trainer wrote"
            )
        yield number, raw


def _add(
    rec: dict[str, Any],
    train: dict[str, dict[int, float]],
    evals: dict[int, float],
    times: list[float],
) -> None:
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**53:
        return  # no usable step: nothing to place on the x axis
    t = json_number(rec.get("time"))
    if t is not None and math.isfinite(t):
        times.append(t)
    kind = rec.get("kind", "train")
    if kind not in ("train", "eval"):
        return  # a kind this reader does not know: not plotted as training
    if kind == "eval":
        for key in _EVAL_LOSS_KEYS:
            value = json_number(rec.get(key))
            if value is not None:
                evals[step] = value
                break
        return
    for key, raw in rec.items():
        value = json_number(raw)
        if value is not None and key not in ("step", "epoch", "time"):
            train.setdefault(key, {})[step] = value
