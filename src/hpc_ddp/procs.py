"""Which process a pid names, for good: the pid and the process's start time.

A pid is handed out again once its process has ended. Whoever keeps a pid to act on it
later must know the process is still the one recorded: a local job's id (``hpc status``
and ``hpc cancel`` signal it), a checkpoint lock's owner, a rank's heartbeat (the
supervisor stops and kills ranks by it). The start time in clock ticks after boot
(``/proc/PID/stat`` field 22) differs for a reused pid, so the pair names one process.
"""

from __future__ import annotations


def process_stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter (R, S, T = stopped, Z = zombie...) and start time, in
    clock ticks after boot, from one read of ``/proc/PID/stat``, so both describe the same
    process even when the pid is reused between two reads; None when it does not exist
    (or there is no ``/proc``)."""
    fields = _stat_fields(pid)
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _stat_fields(pid: int | str) -> list[str]:
    """``/proc/PID/stat`` after the name: state, ppid, pgrp, session, ... (empty when
    the process does not exist or there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            line = fh.read(4096)
    except OSError:
        return []
    return line.rpartition(")")[2].split()  # the name in (...) may hold spaces and ")"


def _live() -> list[tuple[int, list[str]]]:
    """Every live (not zombie) process and its stat fields (none without ``/proc``)."""
    import os

    out = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            fields = _stat_fields(name)
            if len(fields) > 2 and fields[0] != "Z":
                out.append((int(name), fields))
    return out


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``: what a signal to the
    group reaches once its leader has exited and waits to be reaped."""
    return [pid for pid, fields in _live() if fields[2] == str(pgid)]


def descendants(*pids: int) -> list[int]:
    """The live processes below ``pids`` (children, theirs, ...), parents first: a job
    that is a tree of processes but no group of its own (submitit's local controller
    under its setup shell, its ranks under it) is reached through these. One read of
    the process table, so a process forked later is not among them."""
    children: dict[int, list[int]] = {}
    for child, fields in _live():
        if fields[1].isascii() and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(child)
    out: list[int] = []
    seen = set(pids)
    todo = list(pids)
    while todo:
        below = [c for p in todo for c in children.get(p, []) if c not in seen]
        seen.update(below)
        out.extend(below)
        todo = below
    return out


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; None when it does not
    exist (or there is no ``/proc``)."""
    stat = process_stat(pid)
    return None if stat is None else stat[1]


def process_state(pid: int, start: int | None) -> str | None:
    """The state letter of process ``pid`` when it is the process recorded (it started at
    ``start``, where one was recorded), else None: gone, a pid reused by another process,
    or a pid of 0 or less, which a signal would take for a whole process group."""
    stat = process_stat(pid) if pid > 0 else None  # one read: state and start agree
    if stat is None or (start is not None and stat[1] != start):
        return None
    return stat[0]
