"""Which rank failed a job, and its last lines, for ``hpc status RUN`` (issue 31 item 2).

On a 1,000-node job the first question after a failure is which rank failed and what it
said last. The answer comes from what the run already has: SLURM's own exit report in the
job log, the supervisor's failure record in run.json, and the ranks' output (per-rank
files ``RUN/ranks/rank-NNNNN.log``, or the rank-labelled merged job log where per-rank
files are off).

The rule for "the failing rank", first that applies:

1. **The launcher's word.** srun reports each task that ended by itself with an error as
   ``srun: error: HOST: task N: Exited with exit code K`` (``tasks N-M`` for a range); the
   tasks srun then ended itself (``--kill-on-bad-exit``) are reported as ``Killed`` or
   ``Terminated``, so they are consequences, not causes. The first "Exited with exit
   code" line of the job log names the rank and its host. PALS ``mpiexec`` says
   ``HOST: rank N exited with code K`` (see :data:`_PALS_EXIT`).
2. **The supervisor's word.** The latest ``failure`` event in run.json's
   ``supervisor.events`` (written by ``ddp.supervise``) lists the ranks it found dead or
   stopped; the first of them.
3. **The ranks' own output.** A rank whose lines hold the trainer's ``rank N failed:``
   line (``ddp.parts.die``) or a Python ``Traceback (most recent call last):``. In the
   merged log the first such line in time order wins (a peer's traceback about the
   closed connection comes after the cause's); with per-rank files there is no order
   across files, so the lowest such rank.

Logs are untrusted and may be huge: each file is read from its end, at most
:data:`TAIL_BYTES`, decoded with replacement; each quoted line is cut to
:data:`MAX_CHARS` and its control characters are replaced, so a binary or escape-laden
line cannot garble the terminal. A rank with no lines in that window is quoted as such.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

from hpc.errors import UserError

#: How much of each log's end is read (the failing rank's last lines are near the end).
TAIL_BYTES = 256 * 1024
#: Lines quoted from the failing rank.
LINES = 8
#: The longest quoted line (a longer one is cut, with an ellipsis).
MAX_CHARS = 300

# "srun: error: n2: task 1: Exited with exit code 1"; "srun: error: n2: tasks 2-3: ..."
_SRUN_EXIT = re.compile(
    rb"srun: error: (\S+): tasks? ([0-9]{1,9})(?:-[0-9]+)?: "
    rb"Exited with exit code ([0-9]{1,9})(?![0-9])"
)
# PALS (Aurora, Polaris): "HOST: rank N exited with code K", one line per rank, K 0 for
# the clean ones; the ranks PALS then ends are "rank N died from signal 15" (a cascade).
# As captured on Sunspot by ALCF's ezpz (https://github.com/saforem2/ezpz, src/ezpz/
# launch auto-retry, job 12471663); HPE's mpiexec(1) is behind its portal: unverified.
_PALS_EXIT = re.compile(  # 9 digits at most: int() of a job log's 5000 would raise
    rb"^(?:[0-9]+: )?(\S+): rank ([0-9]{1,9}) exited with code ([0-9]{1,9})(?![0-9])"
)
_ERROR_LINE = re.compile(
    rb"Traceback \(most recent call last\):|(?:^|\] )(?:ddp: error: )?"
    rb"rank [0-9]+ failed: "
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _tail(path: Path) -> list[bytes]:
    """The last lines of ``path`` (at most :data:`TAIL_BYTES` from its end; a first line
    cut by the window is dropped unless it is the only one). Regular files only (one
    UserError line otherwise); a missing file is no lines."""
    from hpc._util import open_regular

    fh = open_regular(path, "status", missing_ok=True)
    if fh is None:
        return []
    with fh:
        size = fh.seek(0, 2)
        start = max(0, size - TAIL_BYTES)
        fh.seek(start)
        data = fh.read(TAIL_BYTES)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines = lines[:-1]
    if start > 0 and lines:  # the window began inside a line: marked as cut, kept only
        # when it is all there is (a last line longer than the window)
        lines = lines[1:] if len(lines) > 1 else [b"\xe2\x80\xa6" + lines[0]]
    return lines


def _clean(raw: bytes) -> str:
    """One quotable line: decoded with replacement, control characters replaced, cut."""
    text = _CONTROL.sub("\ufffd", raw.decode("utf-8", "replace").rstrip("\r"))
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "\u2026"


def _labelled(lines: list[bytes]) -> list[tuple[int, bytes]]:
    """``(rank, line without label)`` of the rank-labelled lines (hpc.logs' label rule)."""
    from hpc.logs_ranks import _LABEL

    out = []
    for raw in lines:
        match = _LABEL.match(raw)
        if match:
            out.append((int(match.group(1) or match.group(2)), raw[match.end() :]))
    return out


def _supervisor_rank(record: dict[str, Any]) -> int | None:
    """The first rank of run.json's latest supervisor ``failure`` event (untrusted)."""
    sup = record.get("supervisor")
    events = sup.get("events") if isinstance(sup, dict) else None
    if not isinstance(events, list):
        return None
    for ev in reversed(events):
        if isinstance(ev, dict) and ev.get("event") == "failure":
            ranks = ev.get("ranks")
            if isinstance(ranks, list):
                good = [
                    r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r >= 0
                ]
                return min(good) if good else None
            return None
    return None


def failing_rank_lines(
    run_dir: Path, record: dict[str, Any] | None = None, job: str | None = None, lines: int = LINES
) -> list[str]:
    """The summary lines quoting the failing rank (see the module docstring for the rule);
    empty when no rank can be named (no logs, or nothing in them points at a rank)."""
    from hpc import logs_ranks

    merged: list[Path] = []
    with contextlib.suppress(UserError):
        merged = logs_ranks._merged(run_dir, job)
    job_tails = [_tail(p) for p in merged]
    files = logs_ranks.rank_logs(run_dir)

    rank: int | None = None
    host = "?"
    why = ""
    reported = _launcher_report(job_tails)  # 1. the launcher's report of a rank that failed
    if reported is not None:
        rank, host, why = reported
    if rank is None and record:  # 2. the supervisor's failure record
        rank = _supervisor_rank(record)
        if rank is not None:
            why = "the supervisor's failure record (run.json)"
    labelled = [pair for tail in job_tails for pair in _labelled(tail)]
    if rank is None:  # 3. the ranks' own error lines
        if files:
            for r, path in files.items():
                if any(_ERROR_LINE.search(raw) for raw in _tail(path)):
                    rank, why = r, "its log holds an error"
                    break
        else:
            for r, raw in labelled:
                if _ERROR_LINE.search(raw):
                    rank, why = r, "the first error line of the job log"
                    break
    if rank is None:
        return []

    if rank in files:
        where = str(files[rank])
        got = _tail(files[rank])
        if got and (first := logs_ranks._HEADER.match(got[0].decode("utf-8", "replace"))):
            got = got[1:]  # the header line: the host, not output
            host = first.group(1) if host == "?" else host
        elif host == "?":
            host = _file_host(files[rank])
        quoted = got[-lines:]
    else:
        where = ", ".join(str(p) for p in merged) or "no job log"
        quoted = [raw for r, raw in labelled if r == rank][-lines:]
        if host == "?":
            hosts = logs_ranks._hosts(run_dir)
            host = hosts[rank] if rank < len(hosts) else "?"
    head = f"hpc: rank {rank} ({host}) failed ({why}); "
    if not quoted:
        return [head + f"no lines of it in the end of {where}"]
    out = [head + f"its last {len(quoted)} lines ({where}):"]
    out.extend(f"  | {_clean(raw)}" for raw in quoted)
    return out


def _launcher_report(job_tails: list[list[bytes]]) -> tuple[int, str, str] | None:
    """(rank, host, why) from the first line where srun or PALS mpiexec reports a rank
    that exited with a non-zero code; None when no such line is in the job logs' ends."""
    for tail in job_tails:
        for raw in tail:
            m = _SRUN_EXIT.search(raw) or _PALS_EXIT.match(raw)
            if m and int(m.group(3)) != 0:
                by = "srun" if m.re is _SRUN_EXIT else "mpiexec"
                why = f"{by}: exited with exit code {int(m.group(3))}"
                return int(m.group(2)), m.group(1).decode("utf-8", "replace"), why
    return None


def _file_host(path: Path) -> str:
    """The host from a per-rank file's first line (``# rank N of W on HOST``), or ``?``."""
    from hpc._util import open_regular
    from hpc.logs_ranks import _HEADER

    fh = open_regular(path, "status", missing_ok=True)
    if fh is None:
        return "?"
    with fh:
        first = fh.readline(4096).decode("utf-8", "replace")
    m = _HEADER.match(first)
    return m.group(1) if m else "?"
