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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp.supervise_attempt import _say
from hpc_ddp.procs import process_state
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
    return process_state(pid, None)


def _beat_int(beat: dict[str, Any], key: str) -> int | None:
    """A whole number the beat holds under ``key`` (0 .. 2**64), else None: a beat is a
    rank's file, read as untrusted (JSON's true is not a number here)."""
    value = beat.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64:
        return value
    return None


def _pid(beat: dict[str, Any]) -> int:
    """The beat's pid, 0 when it has none (a pid is below 2**31 on every kernel)."""
    pid = _beat_int(beat, "pid") or 0
    return pid if pid < 2**31 else 0


def _rank_state(beat: dict[str, Any]) -> str | None:
    """The state letter of the beat's process (on this host), None when it is gone or its
    pid now names another process (the beat's ``start`` differs): the supervisor stops
    and kills ranks by pid, and must never signal a process that reuses one."""
    return process_state(_pid(beat), _beat_int(beat, "start"))


def _exited(beat: dict[str, Any]) -> bool:
    """True when the beat's process is on this host and no longer exists."""
    return beat.get("host") == _node() and _pid(beat) > 0 and _rank_state(beat) in (None, "Z")


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


#: Seconds a dump's size must stay the same before it counts as whole. faulthandler writes
#: a dump a few bytes at a time from its signal handler (a header, then each frame, for each
#: thread, the main thread last) and NCCL's watchdog streams its file: a copy taken at the
#: first new byte held one thread of a rank's several (CI at 973667b).
SETTLE_S = 0.3


@dataclass
class _Dump:
    """A file a rank is writing for us: the stack file (appended: ``mark`` is its size
    before the ask) or a flight-recorder dump (rewritten: ``before`` is its (mtime, size,
    inode) before the ask, which a rewrite within one mtime tick still changes)."""

    path: Path
    mark: int = 0
    appended: bool = True
    need: str = ""  # text the new part must hold (the main thread's id), "" for none
    before: tuple[int, int, int] | None = None
    size: int = -1
    since: float = 0.0

    def new_part(self) -> bytes:
        data = self.path.read_bytes()
        return data[self.mark :] if self.appended else data

    def changed(self) -> bool:
        """True once the rank has written anything since the ask."""
        try:
            st = self.path.stat()
        except OSError:
            return False
        if not self.appended:
            return (st.st_mtime_ns, st.st_size, st.st_ino) != self.before
        if st.st_size < self.mark:  # truncated (a second ddp.init)
            self.mark = 0
        return st.st_size > self.mark

    def whole(self, now: float) -> bool:
        """True once it has changed, holds ``need`` and kept its size for SETTLE_S."""
        if not self.changed():
            return False
        size = _size(self.path)
        if size != self.size:
            self.size, self.since = size, now
            return False
        if now - self.since < SETTLE_S:
            return False
        if not self.need:
            return True
        part = self.new_part()
        # faulthandler stops after 100 threads with "...": the main thread, dumped last,
        # is then not in it at all
        return self.need.encode() in part or part.endswith(b"\n...\n")


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _main_thread_id(beat: dict[str, Any]) -> str:
    """How faulthandler names the rank's main thread in its header (``Thread 0x%016lx``
    on a 64-bit host), "" when the beat does not say. The main thread is the one stuck in
    the step, and the last one dumped: once its header is in, only its frames are to come."""
    tid = _beat_int(beat, "thread")
    return f"0x{tid:016x}" if tid else ""


@dataclass
class _Asked:
    """A local rank asked for its dumps: its beat, whether it was found stopped, the
    stack dump and, under NCCL, the flight-recorder dump."""

    beat: dict[str, Any]
    stopped: bool
    stack: _Dump
    trace: _Dump | None


def _ended(beat: dict[str, Any]) -> bool:
    return _rank_state(beat) in (None, "Z")


def collect_stacks(
    hb_dir: Path, out: Path, beats: dict[int, dict[str, Any]], sig: int, wait_s: float = 10.0
) -> dict[int, str]:
    """Ask every local rank for its stacks; copy them into ``out``. Returns rank -> state
    at the time of the hang ("stopped", "running", "gone", "remote"; a rank that ends
    while asked is "gone").

    A rank found stopped is continued so it can dump, and stopped again once its stack
    dump is whole (or at the end of ``wait_s``): it should not train on before the kill,
    which for another node comes a probe's start later. Its flight-recorder dump, under
    NCCL, then cannot come (its watchdog is stopped with it). Running ranks are left
    running: each rank's NCCL watchdog polls the rendezvous store, which rank 0's process
    serves, before it reads its recorder pipe, so stopping rank 0 would hold back every
    other node's recorder dump."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # no evidence, but the ranks are still asked, restored, killed
        _say(f"cannot create {out}: {exc}")
    host, states = _node(), {}
    asked: dict[int, _Asked] = {}
    for rank, rec in sorted(beats.items()):
        pid = _pid(rec)
        if rec.get("host") != host or pid <= 0:
            states[rank] = "remote"
            continue
        state = _rank_state(rec)
        states[rank] = {None: "gone", "Z": "gone", "T": "stopped", "t": "stopped"}.get(
            state, "running"
        )
        if states[rank] == "gone":
            continue
        stack = hb_dir / f"stack-rank-{rank}.txt"
        dump = _Dump(stack, mark=_size(stack), need=_main_thread_id(rec))
        try:
            os.kill(pid, sig)
            os.kill(pid, signal.SIGCONT)  # a stopped rank dumps (where it stopped) once continued
        except OSError:
            states[rank] = "gone"  # it ended in between
            continue
        trace = _poke_flight_recorder(hb_dir, rank)
        fr = None if trace is None else _Dump(trace, appended=False, before=_signature(trace))
        asked[rank] = _Asked(rec, states[rank] == "stopped", dump, fr)
    try:
        unfinished = _wait_for_dumps(asked, states, wait_s)
    finally:  # whatever happened, each rank as it was found
        for a in asked.values():
            if a.stopped:
                _stop(a.beat)
    for rank, a in asked.items():
        try:
            _copy_dumps(rank, a, out, unfinished, wait_s)
        except OSError as exc:  # a full or read-only failures folder: the kill goes on
            _say(f"rank {rank}: its dumps not copied into {out}: {exc}")
    return states


def _wait_for_dumps(asked: dict[int, _Asked], states: dict[int, str], wait_s: float) -> set[str]:
    """Wait (at most ``wait_s``) until every asked rank's dumps are whole; a rank found
    stopped is stopped again as soon as its stack dump is. Returns the dumps' paths not
    whole by then (as text)."""
    stacks = set(asked)  # ranks whose stack dump is not whole yet
    traces = {r for r, a in asked.items() if a.trace is not None}
    deadline = time.monotonic() + wait_s
    while (stacks or traces) and time.monotonic() < deadline:
        now = time.monotonic()
        for rank in list(stacks | traces):
            a = asked[rank]
            if _ended(a.beat):  # nothing more will come
                states[rank] = "gone"
                stacks.discard(rank)
                traces.discard(rank)
                continue
            if rank in stacks and a.stack.whole(now):
                stacks.discard(rank)
                if a.stopped:  # as it was found, as soon as it has dumped; its
                    _stop(a.beat)  # recorder's dump cannot come now
                    traces.discard(rank)
            if rank in traces and a.trace is not None and a.trace.whole(now):
                traces.discard(rank)
        time.sleep(0.02)
    left = {str(asked[r].stack.path) for r in stacks}
    return left | {str(t.path) for r in traces if (t := asked[r].trace) is not None}


def _copy_dumps(rank: int, a: _Asked, out: Path, unfinished: set[str], wait_s: float) -> None:
    """``rank-R.txt`` (the stack dump's new part, marked when it was not whole in time),
    the recorder's dump (``.incomplete`` when it was not), and py-spy's view."""
    part = a.stack.new_part() if a.stack.changed() else b""
    if not part:
        part = b"no stack: the rank did not answer the signal\n"
    elif str(a.stack.path) in unfinished:
        part += b"\n(the dump was still incomplete after %g s)\n" % wait_s
    (out / f"rank-{rank}.txt").write_bytes(part)
    if a.trace is not None and a.trace.changed():
        tail = ".incomplete" if str(a.trace.path) in unfinished else ""
        shutil.copyfile(a.trace.path, out / f"{a.trace.path.name}{tail}")
    if not _ended(a.beat):
        _py_spy(_pid(a.beat), a.stopped, out / f"rank-{rank}.py-spy.txt")


def _py_spy(pid: int, stopped: bool, dest: Path) -> None:
    """``py-spy dump`` of the rank where py-spy is installed, after the faulthandler dump.
    A stopped rank is read without attaching (``--nonblocking``: it is frozen already, and
    ptrace on a stopped process is unreliable); a py-spy that fails or hangs only leaves
    its file."""
    if not shutil.which("py-spy"):
        return
    argv = ["py-spy", "dump", "--pid", str(pid)] + (["--nonblocking"] if stopped else [])
    with open(dest, "w") as fh:
        try:
            subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            fh.write(f"py-spy: {exc}\n")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _stop(beat: dict[str, Any]) -> None:
    """SIGSTOP the beat's rank while its pid still names it."""
    if _rank_state(beat) in (None, "Z"):
        return
    try:
        os.kill(_pid(beat), signal.SIGSTOP)
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
        if rec.get("host") == host and _rank_state(rec) is not None:
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
