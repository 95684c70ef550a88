"""Which process a pid names, for good: the pid and the process's start time.

A pid is handed out again once its process has ended. Whoever keeps a pid to act on it
later must know the process is still the one recorded: a local job's id (``hpc status``
and ``hpc cancel`` signal it), a checkpoint lock's owner, a rank's heartbeat (the
supervisor stops and kills ranks by it). The start time in clock ticks after boot
(``/proc/PID/stat`` field 22) differs for a reused pid, so the pair names one process.
"""

from __future__ import annotations

import os


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; None when it does not
    exist (or there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            line = fh.read(4096)
    except OSError:
        return None
    fields = line.rpartition(")")[2].split()  # the name in (...) may hold spaces and ")"
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: int, start: int | None) -> bool:
    """True when ``pid`` exists and, where ``start`` was recorded, started then (else it
    is another process that reuses the pid). A pid of 0 or less is never one: signalling
    it would reach a whole process group."""
    if pid <= 0:
        return False
    now = process_start(pid)
    if now is None:
        if os.path.isdir("/proc/self"):
            return False  # /proc is there, the pid is not
        try:  # no /proc (macOS): whether the pid exists is all there is to know
            os.kill(pid, 0)
        except PermissionError:
            return True
        except (OSError, OverflowError):  # gone, or no pid at all
            return False
        return True
    return start is None or now == start
