"""Leaving a process group without a crash at exit: wait until Gloo's worker threads idle.

Split from :mod:`ddp.dist` (which re-exports both names): :func:`ddp.dist.shutdown` and
the exit hook :func:`ddp.init` registers call :func:`_quiesce` after destroying the
process group; why that wait is needed is its docstring.
"""

from __future__ import annotations

import os


def _quiesce(limit_s: float = 2.0) -> None:
    """Wait, with the GIL released, until Gloo's worker threads are idle.

    torch 2.13 never frees a Gloo group after ``destroy_process_group`` (C++ keeps it),
    so its worker threads run until the process ends. A worker that finishes a
    collective after the caller moved on still holds the input tensor; when it drops
    the last reference after the interpreter started finalizing, freeing the tensor's
    Python object needs the GIL, CPython ends the thread with ``pthread_exit``, and the
    forced unwind through a C++ destructor aborts the process: "terminate called
    without an active exception" (a core dump of this project's 2-node srun test shows
    exactly that stack, under CPU contention). Sleeping here hands such a worker the
    GIL while Python is whole; the wait ends once no ``pt_gloo_runloop`` thread is
    runnable in two successive looks (Linux /proc), or after ``limit_s``.
    """
    import time

    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
        quiet = quiet + 1 if not _gloo_busy() else 0


def _gloo_busy() -> bool:
    """True while a Gloo worker thread of this process is running or runnable."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False  # not Linux: the sleeps above are all there is
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        if name.startswith("pt_gloo") and stat[stat.rfind(")") + 2] == "R":
            return True
    return False
