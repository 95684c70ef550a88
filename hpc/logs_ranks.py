"""A job's per-rank logs (``per_rank_logs``: ``RUN/ranks/rank-NNNNN.log``) and, without
them, the rank-labelled lines of its merged job log (``srun --label``, PALS ``--label``,
hydra's ``-prepend-rank``): ``hpc logs --rank N`` and ``hpc logs --grep TEXT``."""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path
from typing import Any, TextIO

from hpc.errors import UserError
from hpc.logs_find import err_log, find_log
from hpc_ddp.run_layout import RANKS

RANKS_DIR = RANKS  # per_rank_logs: ddp.rank_logs writes RUN/ranks/rank-NNNNN.log
_RANK_FILE = re.compile(r"rank-([0-9]{5,9})\.log")
_HEADER = re.compile(r"# rank [0-9]+ of [0-9]+ on (\S+)")


def rank_logs(run_dir: Path) -> dict[int, Path]:
    """``{rank: file}`` of a run with ``per_rank_logs`` (empty without them)."""
    folder = run_dir / RANKS_DIR
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = _RANK_FILE.fullmatch(path.name)
        if match and path.is_file():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def rank_log(run_dir: Path, rank: int) -> Path:
    """The log of ``rank``; one line naming what the run has otherwise."""
    logs = rank_logs(run_dir)
    if rank in logs:
        return logs[rank]
    if not logs:
        raise UserError(
            f"logs: {str(run_dir)!r} has no per-rank logs; allowed: --rank for a "
            "job submitted with per_rank_logs: true (or --per-rank-logs)"
        )
    span = f"{min(logs)}-{max(logs)}" if len(logs) > 1 else str(min(logs))
    raise UserError(
        f"logs: no log of rank {rank} in {str(run_dir / RANKS_DIR)!r}; allowed: ranks {span}"
    )


#: A launcher's rank label at a line's start, where per-rank files are off
#: (hpc.launchers.labelled): ``N: `` from ``srun --label`` (N right-aligned with spaces
#: to the widest rank) and PALS ``--label``; ``[N] `` from MPICH hydra's ``-prepend-rank``.
_LABEL = re.compile(rb" *([0-9]{1,9}): |\[([0-9]{1,9})\] ")
#: The longest line read whole from a merged log (a longer one is read in pieces).
_MAX_LINE = 1 << 20


def labelled_lines(path: Path) -> Any:
    """``(rank, line without its label)`` for each rank-labelled line of a merged job
    log (bytes, newline kept); the batch script's own lines (no label) are skipped.
    The log is untrusted: a regular file only, read a bounded line at a time."""
    from hpc._util import open_regular

    fh = open_regular(path, "logs", missing_ok=True)
    if fh is None:
        return
    with fh:
        for raw in iter(lambda: fh.readline(_MAX_LINE), b""):
            match = _LABEL.match(raw)
            if match:
                yield int(match.group(1) or match.group(2)), raw[match.end() :]


def _merged(run_dir: Path, job: str | None) -> list[Path]:
    """The job log (and its ``--err`` file with ``split_logs``) whose lines carry labels."""
    out = find_log(run_dir, job)
    with contextlib.suppress(UserError):  # no split_logs: the one file holds both
        return [out, err_log(run_dir, out)]
    return [out]


def print_rank(run_dir: Path, rank: int, out: TextIO, job: str | None = None) -> None:
    """Print rank ``rank``'s lines of the merged job log, labels removed (as its own
    file would hold them); one line naming what the log has otherwise."""
    seen: set[int] = set()
    try:
        merged = _merged(run_dir, job)
    except UserError:  # neither per-rank files nor a job log: say the first
        raise UserError(
            f"logs: {str(run_dir)!r} has no per-rank logs and no job log; "
            "allowed: --rank for a job submitted with per_rank_logs: true, or "
            "one whose log has rank labels"
        ) from None
    for path in merged:
        for r, line in labelled_lines(path):
            seen.add(r)
            if r == rank:
                out.write(line.decode("utf-8", "replace"))
    out.flush()
    if rank in seen:
        return
    if not seen:
        raise UserError(
            f"logs: {str(run_dir)!r} has no per-rank logs and its job log has no "
            "rank labels; allowed: --rank for a job submitted with per_rank_logs: "
            "true, or one launched with rank labels (srun --label, mpiexec --label "
            "or -prepend-rank)"
        )
    span = f"{min(seen)}-{max(seen)}" if len(seen) > 1 else str(min(seen))
    raise UserError(
        f"logs: no line of rank {rank} in the job log of {str(run_dir)!r}; allowed: ranks {span}"
    )


def _hosts(run_dir: Path) -> list[str]:
    """Each rank's host, from the trainer's ``ranks.jsonl`` (its first line); empty
    when the run has none (not a Trainer run, or not started)."""
    from hpc import ranks

    for path in (run_dir / "ranks.jsonl", *sorted(run_dir.glob("*/ranks.jsonl"))):
        if path.is_file():
            try:
                return ranks.read(path).hosts
            except UserError:
                return []
    return []


def grep(run_dir: Path, text: str, out: TextIO, job: str | None = None) -> list[tuple[int, str]]:
    """Print every line of the per-rank logs that holds ``text`` (plain text, not a
    pattern), as ``rank N (HOST): line``; returns the (rank, host) pairs it was found in.
    Without per-rank files, the rank-labelled lines of the merged job log are searched
    (hosts from the trainer's ``ranks.jsonl`` where it wrote one, else ``?``)."""
    from hpc._util import open_regular

    if not text:
        raise UserError("logs: empty --grep text; allowed: the text to find")
    logs = rank_logs(run_dir)
    if not logs:
        return _grep_merged(run_dir, text, out, job)
    needle = text.encode("utf-8", "surrogateescape")
    found: list[tuple[int, str]] = []
    for rank, path in logs.items():
        host = "?"
        fh = open_regular(path, "logs", missing_ok=True)
        if fh is None:
            continue
        with fh:
            for number, raw in enumerate(iter(functools.partial(fh.readline, 1 << 20), b""), 1):
                if number == 1 and (m := _HEADER.match(raw.decode("utf-8", "replace"))):
                    host = m.group(1)
                    continue
                if needle in raw:
                    line = raw.decode("utf-8", "replace").rstrip("\n")
                    out.write(f"rank {rank} ({host}): {line}\n")
                    if not found or found[-1][0] != rank:
                        found.append((rank, host))
    return found


def _grep_merged(run_dir: Path, text: str, out: TextIO, job: str | None) -> list[tuple[int, str]]:
    """:func:`grep` over a rank-labelled merged job log."""
    needle = text.encode("utf-8", "surrogateescape")
    hosts = _hosts(run_dir)
    found: dict[int, str] = {}
    labelled = False
    for path in _merged(run_dir, job):
        for rank, raw in labelled_lines(path):
            labelled = True
            if needle in raw:
                host = hosts[rank] if rank < len(hosts) else "?"
                line = raw.decode("utf-8", "replace").rstrip("\n")
                out.write(f"rank {rank} ({host}): {line}\n")
                found.setdefault(rank, host)
    if not labelled:
        print_rank(run_dir, 0, out, job)  # the one-line error: no per-rank logs, no labels
    return sorted(found.items())
