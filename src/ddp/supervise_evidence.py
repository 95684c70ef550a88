"""The supervisor's evidence from each rank and node: the ranks' heartbeats, their process
states, their stacks (py-spy or the signal :func:`ddp.heartbeat.install_stack_dump`
installs), NCCL's flight-recorder dumps, and the per-node probes that gather these (and
kill the ranks) on nodes the batch node cannot see.

Split from :mod:`ddp.supervise` (the loop that decides, which re-exports these names); the
launcher-side parts live in :mod:`ddp.relaunch`. The probe's node side runs as
``python -m ddp.supervise --probe ACTION``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.run_layout import HEARTBEATS


def _node() -> str:
    """This node's name as the ranks' heartbeats spell it (ddp.heartbeat.node_name)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


# ---- the ranks ------------------------------------------------------------------------
def read_beats(hb_dir: Path) -> dict[int, dict[str, Any]]:
    """Rank -> last heartbeat; unreadable files are skipped (a beat is replaced whole)."""
    beats: dict[int, dict[str, Any]] = {}
    for f in hb_dir.glob("rank-*.json"):
        try:
            rec = json.loads(f.read_text())
            beats[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return beats


def _proc_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, T = stopped, Z...), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _exited(beat: dict[str, Any]) -> bool:
    """True when the beat's process is on this host and no longer exists."""
    pid = int(beat.get("pid", 0))
    return beat.get("host") == _node() and pid > 0 and _proc_state(pid) in (None, "Z")


# ---- NCCL's flight recorder ----------------------------------------------------------------
#: The ranks' flight-recorder files: ProcessGroupNCCL makes the FIFO ``STEM<rank>.pipe``
#: when TORCH_NCCL_DEBUG_INFO_PIPE_FILE=STEM and the trace buffer is on, and a write to it
#: makes its watchdog thread (alive while the main thread hangs) dump the last collectives
#: to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`` (pytorch torch/csrc/distributed/c10d/
#: ProcessGroupNCCL.cpp ``DumpPipe``; the variables: https://docs.pytorch.org/tutorials/
#: prototype/flight_recorder_tutorial.html). ``torchfrtrace DIR`` reads the copies.
FR_STEM = "nccl-trace-rank-"


def flight_recorder_env(hb_dir: Path) -> dict[str, str]:
    """The variables that turn the recorder and its dump-on-demand pipe on (the user's own
    settings win). No cost outside NCCL: other backends never read them."""
    stem = str(hb_dir / FR_STEM)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": stem,
        "TORCH_FR_DUMP_TEMP_FILE": stem,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem,
    }


def _poke_flight_recorder(hb_dir: Path, rank: int) -> Path | None:
    """Ask ``rank``'s recorder for a dump; the dump's path, or None without a recorder
    (no FIFO: not NCCL, or the buffer off). Never blocks: a FIFO nobody reads is ENXIO."""
    import stat

    pipe = hb_dir / f"{FR_STEM}{rank}.pipe"
    try:
        if not stat.S_ISFIFO(os.lstat(pipe).st_mode):
            return None
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        os.write(fd, b"1")
    except OSError:
        return None
    finally:
        os.close(fd)
    return hb_dir / f"{FR_STEM}{rank}"


def collect_stacks(
    hb_dir: Path, out: Path, beats: dict[int, dict[str, Any]], sig: int, wait_s: float = 10.0
) -> dict[int, str]:
    """Ask every local rank for its stacks; copy them into ``out``. Returns rank -> state
    at the time of the hang ("stopped", "running", "gone", "remote")."""
    out.mkdir(parents=True, exist_ok=True)
    host, states, pending = _node(), {}, {}
    restop: list[int] = []  # stopped ranks: stopped again once they have dumped
    traces: dict[int, tuple[Path, int]] = {}  # rank -> (flight-recorder dump, mtime before)
    for rank, rec in sorted(beats.items()):
        pid = int(rec.get("pid", 0))
        if rec.get("host") != host or pid <= 0:
            states[rank] = "remote"
            continue
        state = _proc_state(pid)
        states[rank] = {None: "gone", "T": "stopped", "t": "stopped"}.get(state, "running")
        if state is None:
            continue
        stack = hb_dir / f"stack-rank-{rank}.txt"
        before = stack.stat().st_size if stack.exists() else 0
        try:
            os.kill(pid, sig)
            os.kill(pid, signal.SIGCONT)  # a stopped rank dumps (where it stopped) once continued
        except OSError:
            continue
        pending[rank] = (stack, before, pid)
        dump = _poke_flight_recorder(hb_dir, rank)
        if dump is not None:
            traces[rank] = (dump, dump.stat().st_mtime_ns if dump.exists() else 0)
        if states[rank] == "stopped":
            restop.append(pid)
        if shutil.which("py-spy"):
            with open(out / f"rank-{rank}.py-spy.txt", "w") as fh:
                subprocess.run(
                    ["py-spy", "dump", "--pid", str(pid)],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    timeout=30,
                    check=False,
                )
    deadline = time.monotonic() + wait_s
    while (pending or traces) and time.monotonic() < deadline:
        for rank, (stack, before, pid) in list(pending.items()):
            size = stack.stat().st_size if stack.exists() else 0
            if size > before:  # faulthandler writes the dump in one go from its handler
                if pid in restop:  # stopped again at once: continued, it could train on
                    _stop(pid)
                time.sleep(0.05)
                (out / f"rank-{rank}.txt").write_bytes(stack.read_bytes()[before:])
                del pending[rank]
        for rank, (dump, mtime) in list(traces.items()):
            if dump.is_file() and dump.stat().st_mtime_ns != mtime:
                time.sleep(0.1)  # the watchdog writes and closes the file in one go
                shutil.copyfile(dump, out / dump.name)
                del traces[rank]
        time.sleep(0.02)
    for rank in pending:
        (out / f"rank-{rank}.txt").write_text("no stack: the rank did not answer the signal\n")
    for pid in restop:  # as it was found: it must not train on (or finish) before the kill,
        _stop(pid)  # which for another node's rank comes a probe's start later
    return states


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGSTOP)
    except OSError:
        pass


#: Seconds a per-node probe may take (srun's step launch, the stack wait of
#: :func:`collect_stacks`, Python's start): a node that does not answer in time is unhealthy.
PROBE_TIMEOUT_S = 60.0


def probe_nodes(
    nodes: Sequence[str],
    run_dir: Path,
    fdir: Path,
    action: str,
    prefix: Callable[[str], list[str]],
    timeout_s: float = PROBE_TIMEOUT_S,
) -> dict[str, dict[int, str] | None]:
    """Run ``python -m ddp.supervise --probe ACTION`` on each node (one task each, in
    parallel, inside the job's allocation, started by ``prefix(node)``:
    :func:`ddp.relaunch.probe_prefix`): ``stacks`` collects the node's ranks' stacks into
    ``fdir`` and reports their states, ``kill`` SIGKILLs them.

    Why: the supervisor runs on the batch node; a rank on another node can be neither
    signalled nor seen in /proc from there, so without this a hung rank on n2 left no
    stack and both nodes were named. Returns node -> {rank: state}, or None for a node
    whose probe failed or did not answer within ``timeout_s`` (an unhealthy node)."""
    procs = {}
    for node in nodes:
        cmd = [
            *prefix(node),
            sys.executable,
            "-m",
            "ddp.supervise",
            "--probe",
            action,
            "--run-dir",
            str(run_dir),
            "--failures-dir",
            str(fdir),
        ]
        procs[node] = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    out: dict[str, dict[int, str] | None] = {}
    for node, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop_launcher(proc, grace_s=2.0)
            out[node] = None
            continue
        found = [x for x in text.splitlines() if x.startswith("{")]
        try:
            rec = json.loads(found[-1]) if proc.returncode == 0 and found else None
            out[node] = {int(r): str(st) for r, st in rec["states"].items()} if rec else None
        except (ValueError, KeyError, TypeError, AttributeError):
            out[node] = None
    return out


def _probe_here(run_dir: Path, fdir: Path, action: str, sig: int) -> int:
    """The probe's side (on the node srun put it on): this node's ranks only."""
    hb_dir = run_dir / HEARTBEATS
    mine = {r: b for r, b in read_beats(hb_dir).items() if b.get("host") == _node()}
    if action == "stacks":
        states = collect_stacks(hb_dir, fdir, mine, sig)
    else:
        _kill_ranks(mine)
        states = {r: "killed" for r in mine}
    print(json.dumps({"node": _node(), "states": states}), flush=True)
    return 0


def _kill_ranks(beats: dict[int, dict[str, Any]]) -> None:
    host = _node()
    for rec in beats.values():
        if rec.get("host") == host and int(rec.get("pid", 0)) > 0:
            try:
                os.kill(int(rec["pid"]), signal.SIGKILL)
            except OSError:
                pass


def _stop_launcher(proc: subprocess.Popen, grace_s: float = 15.0) -> int:
    """SIGTERM the launcher's process group, SIGKILL it after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()
