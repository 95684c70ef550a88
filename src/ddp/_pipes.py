"""Closed pipes: every command line of the compute side ends quietly when its reader goes away.

``hpc logs RUN | head -1``: ``head`` exits after one line and hpc's next write fails.
C programs (coreutils) die of SIGPIPE there, silently, and a shell reports 141
(128 + SIGPIPE). Python ignores SIGPIPE, so the write raises ``BrokenPipeError`` instead:
a traceback, and at exit a second one from flushing ``sys.stdout`` (exit 120). Each
entry point (``python -m ddp``, ``python -m ddp.data``, ``ddp-exec``) runs its main
through :func:`run_main`, which turns exactly that case into the coreutils outcome:
nothing printed, exit 141. A command that ``ddp-exec`` becomes gets SIGPIPE back
(:func:`default_sigpipe`).

The login side (``hpc``) never imports ``ddp`` and this side never imports ``hpc``:
``hpc._pipes`` holds the same rule for ``hpc`` and ``python -m hpc.sweep``.
"""

from __future__ import annotations

import contextlib
import logging
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
    streams still have readers (another pipe) is a real error and is raised again.
    """
    try:
        try:
            return main()
        finally:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:  # started with >&- or 2>&-: Python has None there
                    stream.flush()
    except BrokenPipeError:
        gone = [s for s in (sys.stdout, sys.stderr) if reader_gone(s)]
        if not gone:
            raise
        for stream in (sys.stdout, sys.stderr):
            detach(stream)  # both: the exit flush of either must not print or fail
        return SIGPIPE_EXIT


class OutputHandler(logging.StreamHandler):
    """A log handler for stdout that goes quiet once nobody reads it.

    ``logging`` answers a failed write with a traceback on stderr per record, so
    ``python -m ddp RECIPE | head -1`` printed one for every log line of the run. The
    run goes on instead (metrics and checkpoints are files; only the echo is lost), as
    ``hpc run`` keeps a job going when its own stdout goes away.
    """

    def handleError(self, record: logging.LogRecord) -> None:
        if reader_gone(self.stream):
            detach(self.stream)  # later records and the buffered rest go nowhere, quietly
            return
        super().handleError(record)


def default_sigpipe() -> None:
    """Give SIGPIPE its default action back before ``exec``: Python ignores it, and an
    ignored signal stays ignored in the program that replaces this one, which then sees
    write errors instead of ending as under a shell (``yes`` says "Broken pipe" and
    exits 1). ``subprocess`` does the same for its children (``restore_signals``)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
