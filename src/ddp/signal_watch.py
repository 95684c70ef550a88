"""Preemption signal handlers for the length of a run, and the SIGTERM watchdog.

The loop acts on a signal at a step boundary (one consistent checkpoint, exit 75). That
needs the main thread to run Python: a Python signal handler only runs between bytecodes
of the main thread. A rank stuck in native code (a collective waiting for a peer that
hangs, a blocked read) never runs it, and the launcher's SIGTERM then only ends the rank
after its own kill delay (torchrun: 30 s, SLURM's KillWait: 30 s) or, for a peer waiting
in a collective, after the collective timeout.

So for SIGTERM a watchdog thread also listens: CPython's C-level handler writes the
signal number to the ``signal.set_wakeup_fd`` descriptor from whatever thread the kernel
picked, even while the main thread is stuck. If the Python handler has not run within
:data:`STUCK_S` seconds, the main thread is stuck; if the process still lives
``grace_s`` seconds after the signal, the rank is not finishing. Either way the watchdog
writes every thread's stack to stderr (so the hang can be diagnosed) and ends the rank
with ``128 + SIGTERM`` = 143, the status a plain SIGTERM gives. A checkpoint being
written at that moment is lost, never corrupted: saves are atomic (``ddp.checkpoint``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ddp import rank_logs

log = logging.getLogger("ddp")

STUCK_S = 5.0
"""Seconds the main thread has to run the Python handler before it counts as stuck."""


class SignalWatch:
    """Install preemption handlers for the length of a run; watch SIGTERM for hangs."""

    def __init__(
        self,
        names: list[str],
        on_signal: Callable[[int], None],
        rank: int = 0,
        grace_s: float | None = 20.0,
    ) -> None:
        self.names = list(names)
        self.on_signal = on_signal
        self.rank = rank
        self.grace_s = grace_s
        self.handled = threading.Event()  # the Python handler ran for SIGTERM
        self._stopped = threading.Event()  # the run ended: the watchdog stands down
        self._old: dict[int, Any] = {}
        self._old_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    @property
    def installed(self) -> bool:
        return bool(self._old)

    def install(self) -> None:
        for name in self.names:
            signum = getattr(signal, name)
            try:
                self._old[signum] = signal.signal(signum, self._handler)
            except ValueError:  # not the main thread: preemption is off
                log.warning("cannot install %s handler outside the main thread", name)
        if signal.SIGTERM in self._old and self.grace_s:  # None or 0: no watchdog
            self._start_watchdog()

    def restore(self) -> None:
        for signum, old in self._old.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, old)
        self._old = {}
        self._stopped.set()
        if self._pipe is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._old_wakeup)
            r, w = self._pipe
            with contextlib.suppress(OSError):
                os.write(w, b"\0")  # tells the watchdog to stop
            if self._thread is not None:
                self._thread.join(timeout=2)
            for fd in (r, w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._pipe = None

    # ---- internals ------------------------------------------------------------------
    def _handler(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            self.handled.set()
        self.on_signal(signum)

    def _start_watchdog(self) -> None:
        r, w = os.pipe()
        os.set_blocking(w, False)  # set_wakeup_fd requires it
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            os.close(r)
            os.close(w)
            return
        if old != -1:  # the application's own event loop uses it: leave that alone
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            log.debug("signal wakeup fd in use; no watchdog for a stuck rank")
            return
        self._old_wakeup = old
        self._pipe = (r, w)
        self._thread = threading.Thread(
            target=self._watch, args=(r,), name="ddp-sigterm-watchdog", daemon=True
        )
        self._thread.start()

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data or 0 in data:
                return  # restore() closed the watch
            if signal.SIGTERM in data:
                break
        t0 = time.monotonic()
        grace = float(self.grace_s or 0.0)
        stuck = min(STUCK_S, grace)
        if not self.handled.wait(stuck) and not self._stopped.is_set():
            self._bail(
                f"the main thread did not respond within {stuck:g} s "
                "(stuck in a collective or native code)"
            )
        if not self._stopped.wait(max(0.0, grace - (time.monotonic() - t0))):
            self._bail(f"the rank did not finish within preemption.grace_s={grace:g} s")

    def _bail(self, why: str) -> None:
        code = 128 + signal.SIGTERM
        try:
            sys.stderr.write(
                f"ddp: rank {self.rank}: SIGTERM and {why}; exiting {code} without a "
                "checkpoint. Stacks of every thread follow.\n"
            )
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            try:
                rank_logs.drain()  # the stacks into the job log before the launcher ends
            finally:
                os._exit(code)
