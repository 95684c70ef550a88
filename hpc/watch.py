"""``hpc status RUN --watch``: one run's state, latest metrics, slowest rank and the
supervisor's restarts, refreshed until the job ends (issue 31).

What is asked how often, and why:

- The scheduler: one batched query a poll (:func:`hpc.core.run_status`, the same one
  ``hpc status`` makes: a sweep's 1,000 tasks or a chain's segments are one ``squeue``
  / ``qstat``), spaced by :class:`hpc.logs.Backoff` up to the profile's ``poll_s``. A
  shared scheduler answers every user's queries; a watch left open for a day must not
  ask it every second.
- ``metrics.jsonl`` and ``run.json`` are local files: read every tick, but only their
  tails (a day-long run's metrics file is megabytes; the last line is what is shown).

On a terminal the view is redrawn in place (rich ``Live``). Without one (a pipe, a
log file, CI) a line is printed only when what it says changes, so ``| tee`` keeps a
short history instead of one screen a second. The exit status is the job's own (as
``hpc logs -f`` gives it); Ctrl-C leaves with 130 and never touches the job: watching
is read-only.

A job that FAILED ends the view with its failing rank, that rank's host and its last
lines (:func:`hpc.status.failure_summary`, the lines plain ``hpc status`` prints): on a
1,000-node job the first thing to ask after "it failed" is "where, and what did it say",
and a watch that just exits 1 would send the user to a second command for it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hpc._util import json_number, printable
from hpc.errors import UserError
from hpc_ddp.run_layout import METRICS, RUN_RECORD, metrics_paths

#: How much of ``metrics.jsonl``'s end is read for its last line (a line is < 8 KiB).
TAIL_BYTES = 64 * 1024
#: Seconds between redraws (local files only; the scheduler is asked on its Backoff).
TICK_S = 1.0


def _clock() -> float:
    """The Backoff's clock (looked up at each call, so tests can replace it)."""
    return time.monotonic()


def _sleep(seconds: float) -> None:
    """A tick's pause (looked up at each call, so tests can replace it)."""
    time.sleep(seconds)


@dataclass
class View:
    """What one look at the run shows; ``lines()`` is the plain rendering."""

    job_id: str
    state: str
    tasks: list[tuple[str, str, str]] = field(default_factory=list)  # (id, label, state)
    metrics: dict[str, Any] | None = None
    restarts: int = 0
    excluded: list[str] = field(default_factory=list)
    stopped: str | None = None
    failure: list[str] = field(default_factory=list)  # the failing rank's summary lines
    #: UNKNOWN is final: a job that ran here whose process is gone and whose record
    #: says nothing (``hpc run`` killed with it) never runs again. Elsewhere UNKNOWN
    #: may be a scheduler that did not answer this time, and the watch goes on.
    unknown_ended: bool = False

    @property
    def ended(self) -> bool:
        """The job and every task or segment it lists will not run again by themselves."""
        from hpc.schedulers import JobState

        states = [self.state, *(s for _, _, s in self.tasks)]
        return all(
            JobState(s).ended or (self.unknown_ended and s == JobState.UNKNOWN)
            for s in states
            if s in JobState.__members__
        )

    def lines(self) -> list[tuple[str, str]]:
        """(key, text) pairs: the key says which line a change replaces (pipes print
        only the lines whose text changed)."""
        out = [("job", f"job {self.job_id} {self.state}")]
        out += [
            (f"task {tid} {label}", f"  {tid} {state} {label}") for tid, label, state in self.tasks
        ]
        if self.metrics is not None:
            out.append(("metrics", metrics_line(self.metrics)))
            slow = self.metrics.get("slowest_rank")
            if slow is not None and _num(slow) is not None:
                out.append(("slowest", f"slowest rank {int(slow)}"))
        if self.restarts or self.excluded or self.stopped:
            out.append(("supervisor", supervisor_line(self.restarts, self.excluded, self.stopped)))
        out += [(f"failure {i}", text) for i, text in enumerate(self.failure)]
        return [(key, printable(text)) for key, text in out]  # run.json is anyone's text


def _num(value: Any) -> float | None:
    """A finite JSON number, else None (a record is untrusted: bools, text, NaN, an
    integer past a float's range, which ``math.isfinite`` itself would raise on)."""
    number = json_number(value)
    return number if number is not None and math.isfinite(number) else None


def metrics_line(rec: dict[str, Any]) -> str:
    """``step S loss L samples/s T`` from one metrics record, leaving out what it lacks."""
    parts = [f"step {rec['step']}"] if _num(rec.get("step")) is not None else []
    loss = _num(rec.get("loss"))
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    for key, name in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
        value = _num(rec.get(key))
        if value is not None:
            parts.append(f"{name} {value:.1f}")
    return "metrics " + (" ".join(parts) or "(no step yet)")


def supervisor_line(restarts: int, excluded: list[str], stopped: str | None = None) -> str:
    """``supervisor: N restart(s), excluded n2`` (run.json's supervisor events)."""
    text = f"supervisor: {restarts} restart{'s' if restarts != 1 else ''}"
    if excluded:
        text += f", excluded {','.join(excluded)}"
    if stopped:
        text += f", stopped: {stopped}"
    return text


def last_metrics(path: Path) -> dict[str, Any] | None:
    """The last complete ``train`` record of a metrics file, from its tail only; None
    when there is none yet. A half-written last line (the trainer is writing) is
    skipped; a file that is not a regular one is one :class:`UserError` line."""
    from hpc._util import open_regular

    fh = open_regular(path, "watch", missing_ok=True)
    if fh is None:
        return None
    with fh:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - TAIL_BYTES))
        tail = fh.read(TAIL_BYTES)
    lines = tail.split(b"\n")
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first may be cut
    for raw in reversed(lines):
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):
            continue  # blank, half-written or damaged: an older line may do
        if isinstance(rec, dict) and rec.get("kind", "train") == "train" and "step" in rec:
            return rec
    return None


def supervisor_events(record: dict[str, Any]) -> tuple[int, list[str], str | None]:
    """(restarts, excluded nodes, why it stopped) from run.json's ``supervisor`` block
    (written by ``ddp.supervise``; untrusted: anything malformed counts as absent)."""
    sup = record.get("supervisor")
    events = sup.get("events") if isinstance(sup, dict) else None
    if not isinstance(events, list):
        return 0, [], None
    restarts, excluded, stopped = 0, [], None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        if ev.get("event") == "restart":
            restarts += 1
        elif ev.get("event") == "exclude" and isinstance(ev.get("excluded"), list):
            excluded = [str(n) for n in ev["excluded"]]
        elif ev.get("event") == "stopped":
            stopped = str(ev.get("why", ""))[:200]
    return restarts, excluded, stopped


def metrics_path(run_dir: Path) -> Path | None:
    """The run's own ``metrics.jsonl`` (beside run.json or under checkpoints/); a
    sweep's tasks have one each, shown by ``hpc report`` rather than here."""
    for path in metrics_paths(run_dir):
        if path.exists():
            return path
    found = sorted(run_dir.glob(f"*/{METRICS}"))
    return found[0] if len(found) == 1 else None


def local_parts(
    run_dir: Path | None,
) -> tuple[dict[str, Any] | None, tuple[int, list[str], str | None]]:
    """(last metrics record, supervisor events) from the run's files (no scheduler)."""
    if run_dir is None:
        return None, (0, [], None)
    from hpc._util import read_regular

    try:  # only the supervisor block is used (and checked): not the whole record's rules
        loaded = json.loads(read_regular(run_dir / RUN_RECORD, "watch").decode("utf-8"))
    except (UserError, ValueError, RecursionError):  # mid-replace or damaged: nothing to add
        loaded = {}
    record = loaded if isinstance(loaded, dict) else {}
    path = metrics_path(run_dir)
    return (last_metrics(path) if path else None), supervisor_events(record)


class Watcher:
    """Looks at a run: the scheduler on a :class:`~hpc.logs.Backoff`, files each time."""

    def __init__(
        self, ident: str, runs_dir: Path, cluster: str | None = None, ask: Any = None
    ) -> None:
        from hpc import core, runs
        from hpc.logs import Backoff

        self.ident, self.runs_dir, self.cluster = ident, runs_dir, cluster
        found = runs.find(ident, runs_dir, history=True)
        self.run_dir = found[0] if found else None
        _, poll_s = core.watch(ident, runs_dir, self.run_dir)  # the profile's poll_s
        self.ask = ask or Backoff(1.0, poll_s, clock=lambda: _clock())
        self.here = core.locate(ident, runs_dir, cluster)[1].runs_here  # View.unknown_ended
        self._sched: tuple[str, str, list[tuple[str, str, str]]] | None = None

    def look(self) -> View:
        """The view now; the scheduler is asked only when the Backoff says so (the
        first look always asks)."""
        from hpc import core

        if self.ask.due() or self._sched is None:  # due() first: the first look arms it
            job_id, state, tasks = core.run_status(self.ident, self.runs_dir, self.cluster)
            self._sched = (job_id, str(state), [(t, lb, str(s)) for t, lb, s in tasks])
        job_id, shown, listed = self._sched  # the words, not JobState: a View is text
        metrics, (restarts, excluded, stopped) = local_parts(self.run_dir)
        return View(
            job_id, shown, listed, metrics, restarts, excluded, stopped, unknown_ended=self.here
        )

    def final(self) -> View:
        """One more scheduler query once the job ended (its end state, not a stale one)."""
        self._sched = None
        return self.look()


def failure_lines(w: Watcher) -> list[str]:
    """The failing rank's summary of the watched run (as plain ``hpc status`` gives it).

    A log that cannot be read (a FIFO where the job log should be) is one line in the
    view instead of an error: the job has ended and the watch still owes its status."""
    from hpc.status import failure_summary

    if w.run_dir is None:
        return []
    try:
        return failure_summary(w.ident, w.runs_dir)
    except UserError as exc:
        return [f"hpc: no failing rank named: {exc}"]


def _ended(w: Watcher, view: View) -> View:
    """``view`` while the job runs; once it ended, the final look (its end state), with
    the failing rank's summary when that state is FAILED (the rule ``hpc status`` uses)."""
    if not view.ended:
        return view
    view = w.final()
    if view.state == "FAILED":
        view.failure = failure_lines(w)
    return view


def run(
    ident: str,
    runs_dir: Path,
    cluster: str | None,
    out: TextIO,
    err: TextIO,
    tty: bool,
    sleep: Callable[[float], None] | None = None,
    watcher: Watcher | None = None,
) -> int:
    """Watch until the job ends; the job's exit status (130 on Ctrl-C, job untouched).
    ``sleep`` and ``watcher``: for tests (no wall-clock waits there)."""
    w = watcher or Watcher(ident, runs_dir, cluster)
    sleep = sleep or (lambda s: _sleep(s))
    try:
        view = _live(w, out, sleep) if tty else _plain(w, out, sleep)
    except KeyboardInterrupt:
        err.write("hpc: stopped watching; the job was not touched\n")
        return 130
    err.write(f"hpc: job ended: {view.state}\n")
    return _exit_status(ident, runs_dir, view.state)


#: A pipe's last lines once the job ended: the run's own lines (which may have changed
#: in the same look), then the job's state and its tasks', then a failure's summary.
_END_ORDER = {"metrics": -1, "slowest": -1, "supervisor": -1}


def _plain(w: Watcher, out: TextIO, sleep: Callable[[float], None]) -> View:
    shown: dict[str, str] = {}
    while True:
        view = _ended(w, w.look())  # the supervisor's last event, the final metrics too
        lines = view.lines()
        if view.ended:  # the end state (and its tasks) after the last metrics, before why
            lines.sort(key=lambda line: _END_ORDER.get(line[0], 2 * line[0].startswith("failure")))
        for key, text in lines:
            if shown.get(key) != text:
                shown[key] = text
                out.write(text + "\n")
                out.flush()
        if view.ended:
            return view
        sleep(TICK_S)


def _live(w: Watcher, out: TextIO, sleep: Callable[[float], None]) -> View:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    def draw(view: View) -> Text:
        return Text("\n".join(text for _, text in view.lines()))  # user text: no markup

    view = _ended(w, w.look())
    with Live(draw(view), console=Console(file=out), auto_refresh=False) as live:
        while not view.ended:
            sleep(TICK_S)
            view = _ended(w, w.look())
            live.update(draw(view), refresh=True)
    return view


def _exit_status(ident: str, runs_dir: Path, state: str) -> int:
    """The job's own exit code, as ``hpc logs -f`` gives it: never 0 for a job that did
    not complete (PBS's qdel can record 0)."""
    from hpc import core

    try:
        code = core.exit_code(ident, runs_dir)
    except UserError:
        code = None
    if state == "COMPLETED":
        return 0 if code is None else code
    return code or 1
