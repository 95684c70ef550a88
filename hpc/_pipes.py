"""Closed pipes: every command line of the login side ends quietly when its reader goes away.

``hpc logs RUN | head -1``: ``head`` exits after one line and hpc's next write fails.
C programs (coreutils) die of SIGPIPE there, silently, and a shell reports 141
(128 + SIGPIPE). Python ignores SIGPIPE, so the write raises ``BrokenPipeError`` instead:
a traceback, and at exit a second one from flushing ``sys.stdout`` (exit 120). Each
entry point (``hpc``, ``python -m hpc.sweep``) runs its main through :func:`run_main`,
which turns exactly that case into the coreutils outcome: nothing printed, exit 141.

The compute side (``ddp``) never imports ``hpc``: ``ddp._pipes`` holds the same rule
for ``python -m ddp``, ``python -m ddp.data`` and ``ddp-exec``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Callable

SIGPIPE_EXIT = 128 + signal.SIGPIPE
"""What a shell reports for a program that SIGPIPE ended (141): ``head``'s writer."""


def reader_gone(stream: object) -> bool:
    """True when ``stream`` is a pipe (or socket, or hung-up terminal) nobody reads any more.

    ``poll`` reports POLLERR for a pipe whose read end is closed and POLLHUP for a
    socket or terminal that hung up: the state itself, not a guess from an exception
    (which may come from any pipe the program writes to, not its own output)."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False  # replaced by an object (a test's capture): no descriptor to lose
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    try:
        events = poller.poll(0)
    except OSError:
        return False
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in events)


def detach(stream: object) -> None:
    """Point ``stream``'s descriptor at /dev/null, so later writes and the interpreter's
    last flush of what is still buffered succeed without a reader (and print nothing)."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        fd = stream.fileno()  # type: ignore[attr-defined]
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)


def run_main(main: Callable[[], int]) -> int:
    """``main()``'s exit code; :data:`SIGPIPE_EXIT` and no output once stdout or stderr
    lost its reader.

    Buffered output is flushed here, inside the guard, so a reader that left early is
    seen now and not by the interpreter's exit. A ``BrokenPipeError`` while both
    streams still have readers (another pipe) is a real error and is raised again. A
    program started with stderr closed (``2>&-``: Python has None there) writes its
    errors to /dev/null; one started with stdout closed is the command's to refuse or
    not (``hpc run >&-`` keeps the job's output in its log only).
    """
    if sys.stderr is None:  # started with 2>&-: errors go nowhere, exit codes stay true
        sys.stderr = open(os.devnull, "w")  # for the process's life
    try:
        try:
            return main()
        finally:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:  # >&-: Python has None there
                    stream.flush()
    except BrokenPipeError:
        gone = [s for s in (sys.stdout, sys.stderr) if reader_gone(s)]
        if not gone:
            raise
        for stream in (sys.stdout, sys.stderr):
            detach(stream)  # both: the exit flush of either must not print or fail
        return SIGPIPE_EXIT
