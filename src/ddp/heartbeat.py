"""Per-rank heartbeats and on-demand stack dumps, for a watcher outside the ranks (issue 30).

Why files: a supervisor (``python -m ddp.supervise``) must tell a running rank from a stuck
one without joining the process group (a hung collective would hang it too) and without
the ranks doing any device work for it. Each rank atomically replaces one small JSON file,
``DIR/rank-R.json`` = ``{"rank", "step", "phase", "time", "pid", "start", "host",
"thread"}`` (``start``: the process's start time, so a watcher never signals a process
that reuses the pid; ``thread``: the main thread's id, which names it in a stack dump),
at most every
``every_s`` seconds. ``step`` is the trainer's host-side counter: a beat never reads a
tensor, so it adds no host-device synchronisation to the hot loop (tests/ddp
test_trainer_sync stays at zero reads); between writes a beat costs one clock read.

Where: ``$DDP_HEARTBEAT_DIR``, which the supervisor sets for its ranks; unset means no
heartbeats, no stack-dump handler and no cost. Not on for every job ``hpc submit`` makes:
ten thousand ranks each replacing a file every 2 s with nobody reading them would be
thousands of metadata operations a second on a shared file system.

Stacks: :func:`install_stack_dump` registers :mod:`faulthandler` on ``$DDP_STACK_SIGNAL``
(default SIGUSR2) writing every thread's Python stack to ``DIR/stack-rank-R.txt``. It is
the C-level handler, so it runs even while the main thread is blocked inside a collective
(where a Python-level handler would wait for the interpreter). A rank stopped with SIGSTOP
dumps as soon as it is continued, showing the frame it was stopped in.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import IO

from hpc_ddp.files import write_atomic
from hpc_ddp.procs import process_start

log = logging.getLogger("ddp")

#: Default seconds between writes: small against any sane hang timeout (minutes), large
#: against a step (a write per step would be a metadata operation per step on Lustre).
EVERY_S = 2.0

_STACK_FILE: IO[str] | None = None  # kept open: faulthandler writes to its descriptor


def heartbeat_dir() -> Path | None:
    """The heartbeat folder from the environment (see the module docstring), or None."""
    explicit = os.environ.get("DDP_HEARTBEAT_DIR")
    return Path(explicit) if explicit else None


def node_name() -> str:
    """The scheduler's name for this node (``$SLURMD_NODENAME``: what ``srun --exclude``
    takes, and distinct for emulated nodes sharing a host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def stack_signal() -> int:
    """``$DDP_STACK_SIGNAL`` (a name such as SIGUSR2) as a number; SIGUSR2 by default."""
    name = os.environ.get("DDP_STACK_SIGNAL", "SIGUSR2")
    sig = getattr(signal, name, None)
    if not isinstance(sig, signal.Signals):
        log.warning("DDP_STACK_SIGNAL=%r is not a signal name; using SIGUSR2", name)
        return int(signal.SIGUSR2)
    return int(sig)


def _every_from_env() -> float:
    """``$DDP_HEARTBEAT_EVERY_S`` (seconds, >= 0; 0 writes every step, for tests), else
    :data:`EVERY_S`."""
    raw = os.environ.get("DDP_HEARTBEAT_EVERY_S")
    try:
        value = float(raw) if raw else EVERY_S
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        log.warning("DDP_HEARTBEAT_EVERY_S=%r is not seconds in [0, 3600]; using %g", raw, EVERY_S)
        return EVERY_S
    return value


class Heartbeat:
    """Publishes one rank's progress; :meth:`beat` is cheap enough to call every step."""

    def __init__(
        self,
        folder: Path | None,
        rank: int,
        every_s: float | None = None,
        node_rank: int | None = None,
    ) -> None:
        self.folder = folder
        self.rank = rank
        # the launcher's index of this rank's node (PALS_NODEID, SLURM_NODEID, GROUP_RANK):
        # ddp.supervise maps it onto its host list, which names nodes the way the hostfile
        # does (an FQDN on Aurora) and tells apart emulated nodes that share one host
        self.node_rank = node_rank
        self.every_s = every_s if every_s is not None else _every_from_env()
        self._next = 0.0  # monotonic time of the next write
        self._host = node_name()
        self._start = process_start(os.getpid())
        self._thread = threading.main_thread().ident  # fixed for the process's life
        if folder is not None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # a watcher's aid must never end the training
                log.warning("heartbeats off: cannot create %s (%s)", folder, exc)
                self.folder = None

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def beat(self, step: int, phase: str = "train", force: bool = False) -> None:
        """Write ``step``/``phase`` when ``every_s`` has passed since the last write (or
        ``force``: phase changes, so a long evaluation starts with a fresh beat)."""
        if self.folder is None:
            return
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + self.every_s
        rec = {
            "rank": self.rank,
            "step": int(step),
            "phase": phase,
            "time": time.time(),
            "pid": os.getpid(),
            "start": self._start,
            "host": self._host,
            "thread": self._thread,
        }
        if self.node_rank is not None:
            rec["node_rank"] = int(self.node_rank)
        path = self.folder / f"rank-{self.rank}.json"
        try:
            # readers see the old beat or the new one, never half
            write_atomic(path, json.dumps(rec))
        except OSError as exc:
            log.warning("heartbeat not written (%s); heartbeats off", exc)
            self.folder = None


def install_stack_dump(rank: int, folder: Path | None = None) -> Path | None:
    """Dump all threads' stacks to ``FOLDER/stack-rank-R.txt`` on the stack signal.

    Returns the file's path, or None when there is no heartbeat folder. Called by
    ``ddp.init``; idempotent within a process."""
    import faulthandler

    global _STACK_FILE
    folder = folder or heartbeat_dir()
    if folder is None:
        return None
    path = folder / f"stack-rank-{rank}.txt"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if _STACK_FILE is not None:
            _STACK_FILE.close()
        _STACK_FILE = open(path, "w")  # must outlive this call
        faulthandler.register(stack_signal(), file=_STACK_FILE, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("stack dumps off: %s (%s)", path, exc)
        return None
    return path
