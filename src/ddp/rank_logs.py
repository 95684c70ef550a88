"""Per-rank log files: ``RUN/ranks/rank-NNNNN.log``, each holding only its rank's lines.

Why: a launcher merges every rank's output into one job log (TorchX#405/#412 asked for
``--tee`` for this), so on many nodes the line that explains a failure is lost among
the others and carries no rank. With ``per_rank_logs: true`` in the spec the rendered
script exports ``DDP_RANK_LOGS=1`` and :func:`ddp.init` calls :func:`redirect` first:

- every rank's stdout and stderr go, at the file-descriptor level (so C++, NCCL and
  subprocess output too), to its own file under ``$HPC_RUN_DIR/ranks`` (``./ranks``
  without a run directory), which starts with a ``# rank R of W on HOST`` line;
- rank 0's stdout and every rank's stderr still reach the job log as well, through a
  ``tee -a`` process per stream: it lives in its own session (a signal to the job's
  process group does not cut it short) and drains the pipe after the rank has died;
- before the rank exits it waits, at most :data:`DRAIN_S` seconds, until its tees have
  copied the last lines (:func:`drain`): each pipe is empty and its tee has exited or
  sleeps in ``read`` on it again, so every byte it read is written (``/proc/PID/syscall``;
  where that cannot be asked, a short grace). A launcher ends the step when the rank exits
  (slurmstepd kills what is left in the step's cgroup), and a tee still copying would
  lose a crash's traceback from both the job log and the rank's file. That happens at
  interpreter exit (a return, ``sys.exit``, an uncaught exception after its traceback)
  and on ddp's own immediate exits (a failed rank, a SIGTERM with no grace left); a rank
  killed by a signal skips it. Output after that point (interpreter shutdown warnings)
  goes to the rank's file only;
- Python's ``sys.stdout``/``sys.stderr`` are made line-buffered: each line is in the
  file when it is printed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from ddp.heartbeat import node_name
from hpc_ddp.run_layout import RANKS, rank_log_name

ENV = "DDP_RANK_LOGS"

#: The longest a rank's exit waits for its tees: reached only when a tee cannot write (a
#: job log on a stalled file system); the rank then exits and leaves the tee copying.
DRAIN_S = 10.0
#: Where the kernel cannot say what a tee is doing (no ``/proc/PID/syscall``): once its
#: pipe is empty, how long the tee gets to write the last chunk it read. A tee exits at
#: once when the rank held the pipe's last write end; a child the rank started (a
#: DataLoader worker, multiprocessing's resource tracker) keeps a copy of fds 1 and 2,
#: and then the tee lives on, which must not cost each exit DRAIN_S. A tee descheduled
#: longer than this on a busy node loses the lines, hence the question when it can be asked.
GRACE_S = 0.2

#: What :func:`drain` has left to do: the rank's file and, by the fd each one copies, its
#: tee and a kept write end of that tee's pipe (fd 3 or above): drain's view of the pipe
#: even when the program has closed or reused fd 1 or 2 itself.
_pending: tuple[Path, dict[int, tuple[subprocess.Popen[bytes], int]]] | None = None


def folder(env: Mapping[str, str] | None = None) -> Path:
    """``$HPC_RUN_DIR/ranks``, else ``./ranks`` (a script rendered and run by hand)."""
    env = os.environ if env is None else env
    return Path(env.get("HPC_RUN_DIR") or ".") / RANKS


def path_of(rank: int, env: dict[str, str] | None = None) -> Path:
    return folder(env) / rank_log_name(rank)


def _tee(path: Path, fd: int, out_fd: int) -> tuple[subprocess.Popen[bytes], int]:
    """Point ``fd`` at a pipe whose reader appends to ``path`` and copies to ``out_fd``;
    returns the reader and a kept copy of the pipe's write end (close-on-exec, >= 3)."""
    import fcntl

    saved = os.dup(out_fd)  # where the stream went before: the job log
    read_end, write_end = os.pipe()
    try:
        tee = subprocess.Popen(
            ["tee", "-a", str(path)],
            stdin=read_end,
            stdout=saved,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(read_end)
        os.close(saved)
    os.dup2(write_end, fd)
    held = fcntl.fcntl(write_end, fcntl.F_DUPFD_CLOEXEC, 3)
    if write_end != fd:  # equal for a rank started with fd 1 or 2 closed: pipe() took it
        os.close(write_end)
    return tee, held


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe behind ``fd`` (Linux answers FIONREAD on either end);
    0 where that cannot be asked, which leaves only the grace."""
    import fcntl
    import termios

    try:
        return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
    except OSError:
        return 0


def _read_syscall() -> bytes | None:
    """This machine's number for ``read(2)`` as ``/proc/PID/syscall`` writes it: the first
    field of that file read by its own process is the read doing it (0 on x86_64, 63 on
    aarch64). None where the file does not exist (no ``/proc``, a kernel without it)."""
    try:
        fd = os.open("/proc/self/syscall", os.O_RDONLY | os.O_CLOEXEC)
        try:
            first = os.read(fd, 64).split(maxsplit=1)[0]
        finally:
            os.close(fd)
    except (OSError, IndexError):
        return None
    return first if first.isdigit() else None


def _copied(pid: int, read_nr: bytes) -> bool | None:
    """Whether tee ``pid`` sleeps in ``read`` on its stdin (fd 0): it then has written
    all it read before. A task woken by new data shows ``running`` until it sleeps
    again, so a stale answer cannot say True. None when it cannot be asked (no
    permission to trace it): the caller falls back to the grace."""
    try:
        with open(f"/proc/{pid}/syscall", "rb") as fh:
            fields = fh.read(256).split()
    except FileNotFoundError:
        return False  # exited: its poll() says so
    except OSError:
        return None
    return fields[:2] == [read_nr, b"0x0"]


def _flush() -> None:
    """Python's streams, then C's (libc's stdout buffer is flushed only by ``exit()``,
    after this point, and would reach the rank's file only)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to copy from it
            pass
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)


def drain() -> None:
    """Point the teed fds at the rank's file and wait until each tee has copied what its
    pipe held (see the module docstring). Once only; nothing to do without
    :func:`redirect`. ddp's ``os._exit`` paths call it, as the interpreter's exit does."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    path, teed = pending
    _flush()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError:  # the file is gone: /dev/null still closes the pipes
        fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    for target in teed:
        os.dup2(fd, target)
    os.close(fd)
    deadline = time.monotonic() + DRAIN_S
    read_nr = _read_syscall()
    for tee, held in teed.values():
        copied: bool | None = None
        try:
            while tee.poll() is None and time.monotonic() < deadline:
                if not _unread(held):
                    copied = None if read_nr is None else _copied(tee.pid, read_nr)
                    if copied is not False:  # done, or only the grace can tell
                        break
                time.sleep(0.005)
        finally:
            with contextlib.suppress(OSError):  # the program closed it: nothing to wait on
                os.close(held)
        if copied is None:
            grace = min(GRACE_S, max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(subprocess.TimeoutExpired):
                tee.wait(timeout=grace)


def redirect(rank: int, world: int) -> Path:
    """Send this rank's output to its file (see the module docstring); returns the file."""
    path = path_of(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"# rank {rank} of {world} on {node_name()} (pid {os.getpid()})\n")
    teed = {2: _tee(path, 2, 2)}
    if rank == 0:
        teed[1] = _tee(path, 1, 1)
    else:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.dup2(fd, 1)
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    global _pending
    _pending = (path.absolute(), teed)  # absolute: the rank may chdir
    atexit.register(drain)
    return path
