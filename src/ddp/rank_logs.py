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
- at exit (a return, ``sys.exit`` or an uncaught exception, after its traceback is
  printed) the rank waits, at most :data:`DRAIN_S` seconds, for its tees to copy the
  last lines: a launcher ends the step when the rank exits (slurmstepd kills what is
  left in the step's cgroup), and a tee still copying would lose a crash's traceback
  from both the job log and the rank's file. Output after that point (interpreter
  shutdown warnings) goes to the rank's file only;
- Python's ``sys.stdout``/``sys.stderr`` are made line-buffered: each line is in the
  file when it is printed.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from ddp.heartbeat import node_name
from hpc_ddp.run_layout import RANKS, rank_log_name

ENV = "DDP_RANK_LOGS"

#: The longest a rank's exit waits for its tees. A tee that outlives it has a pipe held
#: open by a process the rank forked (it keeps its copy of fds 1 and 2) or a job log that
#: does not take writes; the rank then exits and leaves that tee draining.
DRAIN_S = 30.0


def folder(env: Mapping[str, str] | None = None) -> Path:
    """``$HPC_RUN_DIR/ranks``, else ``./ranks`` (a script rendered and run by hand)."""
    env = os.environ if env is None else env
    return Path(env.get("HPC_RUN_DIR") or ".") / RANKS


def path_of(rank: int, env: dict[str, str] | None = None) -> Path:
    return folder(env) / rank_log_name(rank)


def _tee(path: Path, fd: int, out_fd: int) -> subprocess.Popen[bytes]:
    """Point ``fd`` at a pipe whose reader appends to ``path`` and copies to ``out_fd``."""
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
    os.close(write_end)
    return tee


def _drain(path: Path, teed: dict[int, subprocess.Popen[bytes]]) -> None:
    """At exit: point the teed fds at the rank's file, which closes this process's write
    ends of the pipes, and wait for each tee to reach the end of its pipe and exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to copy from it
            pass
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError:  # the file is gone: /dev/null still closes the pipes
        fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    for target in teed:
        os.dup2(fd, target)
    os.close(fd)
    deadline = time.monotonic() + DRAIN_S
    for tee in teed.values():
        try:
            tee.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # see DRAIN_S: leave it draining
            pass


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
    atexit.register(_drain, path.absolute(), teed)  # absolute: the rank may chdir
    return path
