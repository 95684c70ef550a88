"""The supervisor's record in ``RUN/run.json`` and one attempt of the launch command.

Split from :mod:`ddp.supervise` (which re-exports every name here) by what a reader looks
for: :func:`record` appends one event to ``run.json`` under the lock ``hpc`` takes too
(:func:`hpc_ddp.files.locked`, written atomically), and :class:`Attempt` runs the launcher
once, tees its output and classifies a failed exit (a configuration error, a full disk,
the same exception on every rank and a preemption end the job; anything else is a node's
fault and relaunches). The loop that decides between attempts stays in
:mod:`ddp.supervise`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from hpc_ddp.files import locked, write_atomic
from hpc_ddp.run_layout import RUN_RECORD

PREEMPTED = 75  # ddp.preemption.PREEMPTED_EXIT_CODE, without importing torch here
_RANK_FAILED = re.compile(r"^(?:\[rank \d+\] )?(?:ddp: error: )?rank (\d+) failed: (.+)$")
_NO_SPACE = re.compile(r"No space left on device|ENOSPC")
_CONFIG_ERROR = re.compile(r"^ddp: error: ")
_RUN_JSON_LIMIT = 8 << 20  # run.json is a small record; anything larger is not ours


def _say(msg: str) -> None:
    print(f"supervise: {msg}", file=sys.stderr, flush=True)


def _fail(msg: str) -> NoReturn:
    print(f"supervise: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# ---- run.json ---------------------------------------------------------------------------
def record(run_dir: Path, event: dict[str, Any]) -> None:
    """Append one event to ``run.json``'s ``supervisor.events`` (atomic replace), under
    the run's ``.lock`` (the flock ``hpc`` holds for its own read-modify-write of the
    record, :func:`hpc_ddp.files.locked` on both sides, so neither side's update is lost)."""
    with locked(run_dir / ".lock"):
        _record(run_dir, event)


def _record(run_dir: Path, event: dict[str, Any]) -> None:
    path = run_dir / RUN_RECORD
    data: dict[str, Any] = {}
    if path.is_file() and path.stat().st_size <= _RUN_JSON_LIMIT:
        try:
            loaded = json.loads(path.read_text())
            data = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            _say(f"{path} is not JSON; writing the supervisor's record beside nothing else")
    sup = data.setdefault("supervisor", {})
    if not isinstance(sup, dict):
        sup = data["supervisor"] = {}
    events = sup.setdefault("events", [])
    # "t": the same instant in epoch seconds, sub-second: bench/recovery.py splits a
    # recovery (kill -> failure -> restart -> first step) from these and the ranks' times
    now = time.time()
    events.append(
        {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
            "t": round(now, 3),
            **event,
        }
    )
    sup["restarts"] = sum(1 for e in events if e.get("event") == "restart")
    write_atomic(path, json.dumps(data, indent=1))


# ---- one attempt ----------------------------------------------------------------------
class Attempt:
    """One launch: the process, its teed output, and what was learned from it."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.lines: list[str] = []
        self.log = open(log_path, "w")  # closed by the reader thread
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._tee, daemon=True)
        self.reader.start()

    def _tee(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            self.log.write(line)
            self.log.flush()
            if len(self.lines) < 100_000:  # bounded: only failure lines are looked at
                self.lines.append(line.rstrip("\n"))
        self.log.close()

    def classify(self, world: int) -> tuple[str, str]:
        """(kind, why) of a failed exit: kind "fatal" ends the job, "node" relaunches."""
        self.reader.join(timeout=30)
        if self.proc.returncode == PREEMPTED:
            return "fatal", "preempted (exit 75): the scheduler's requeue resumes it"
        if self.proc.returncode == 2 or any(_CONFIG_ERROR.match(x) for x in self.lines):
            return "fatal", "a configuration error (ddp: error:), not a node failure"
        if any(_NO_SPACE.search(x) for x in self.lines):
            return "fatal", "no space left on device (ENOSPC): a full disk, not a node failure"
        failed: dict[int, str] = {}
        for x in self.lines:
            m = _RANK_FAILED.match(x)
            if m:
                failed[int(m.group(1))] = m.group(2)
        if world and len(failed) >= world and len(set(failed.values())) == 1:
            return "fatal", f"every rank raised the same error: {next(iter(failed.values()))}"
        return "node", f"exit {self.proc.returncode}" + (
            f"; ranks {sorted(failed)} reported errors" if failed else ""
        )


def _world(hb_dir: Path) -> int:
    """Ranks that reached ``ddp.init`` in this attempt (each made its stack file there)."""
    return len(list(hb_dir.glob("stack-rank-*.txt")))


def _clear(hb_dir: Path) -> None:
    hb_dir.mkdir(parents=True, exist_ok=True)
    for f in (*hb_dir.glob("rank-*.json"), *hb_dir.glob("stack-rank-*.txt")):
        f.unlink(missing_ok=True)
