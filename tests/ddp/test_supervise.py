"""``python -m ddp.supervise`` around a real torchrun with 2 Gloo ranks (issue 30, item 2).

Each test waits on events (a file appearing, a process exiting); the bounds are only
against a true hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.ddp import _launch
from tests.support.ports import free_port

WORKER = "tests/ddp/_index_worker.py"
N, BATCH = 48, 4  # 6 steps per rank in the epoch


def _spec(tmp: Path, **extra: object) -> dict:
    logs = tmp / "seen"
    logs.mkdir(exist_ok=True)
    return {
        "n": N,
        "log_dir": str(logs),
        **extra,
        "config": {
            "training": {"batch_size": BATCH, "epochs": 1, "shuffle": True, "seed": 3},
            "optim": {"name": "sgd", "lr": 0.01},
            "checkpoint": {"dir": str(tmp / "ckpt"), "every_n_steps": 2, "save_final": False},
            "logging": {"every_n_steps": 2, "progress": "off"},
        },
    }


def _start(tmp: Path, spec: dict, *opts: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "ddp.supervise",
        "--run-dir",
        str(tmp / "run"),
        "--poll-s",
        "0.1",
        *opts,
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        WORKER,
        json.dumps(spec),
    ]
    env = _launch.base_env()
    env.pop("HPC_RUN_DIR", None)
    return subprocess.Popen(
        cmd, env=env, cwd=_launch.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"supervisor exited {proc.returncode} before {path}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _events(tmp: Path) -> list[dict]:
    return json.loads((tmp / "run" / "run.json").read_text())["supervisor"]["events"]


def _lines(tmp: Path) -> list[tuple[int, int, list[int]]]:
    out = []
    for f in (tmp / "seen").glob("*.txt"):
        for line in f.read_text().splitlines():
            epoch, step, *ids = map(int, line.split())
            out.append((int(f.stem), step, ids))
    return out


def test_sigkill_one_rank_relaunches_and_resumes_exactly(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.mkdir()
    spec = _spec(tmp_path, hold={"rank": 1, "step": 4, "dir": str(hold)})
    sup = _start(tmp_path, spec, "--hang-timeout-s", "60", "--max-restarts", "2")
    _wait_for(hold / "ready", sup)  # rank 1 is about to train step 5; step 4 is saved
    os.kill(int((hold / "ready").read_text()), signal.SIGKILL)
    (hold / "released").touch()
    out, err = sup.communicate(timeout=180)
    assert sup.returncode == 0, err[-4000:]
    kinds = [e["event"] for e in _events(tmp_path)]
    assert kinds == ["failure", "restart", "completed"], kinds
    assert "restarting" in err and "attempt 2 completed" in err
    lines = _lines(tmp_path)
    per_key = Counter((rank, step) for rank, step, _ in lines)
    # steps 1-4 were trained once (the relaunch resumed from step 4's checkpoint, not 0)
    assert all(per_key[(r, s)] == 1 for r in (0, 1) for s in range(1, 5)), per_key
    trained = {(rank, step): ids for rank, step, ids in lines}
    assert sorted(i for ids in trained.values() for i in ids) == list(range(N))
    # a step trained in both attempts got the same samples (the exact resume)
    again = [(r, s, ids) for r, s, ids in lines if per_key[(r, s)] > 1]
    assert all(trained[(r, s)] == ids for r, s, ids in again)


def test_sigstop_one_rank_is_a_hang_with_stacks_then_relaunch(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.mkdir()
    spec = _spec(tmp_path, hold={"rank": 1, "step": 2, "dir": str(hold)})
    timeout_s = 10.0  # above a step or a checkpoint load on this loaded 2-core machine
    sup = _start(tmp_path, spec, "--hang-timeout-s", str(timeout_s), "--max-restarts", "1")
    _wait_for(hold / "ready", sup)
    os.kill(int((hold / "ready").read_text()), signal.SIGSTOP)
    stopped = time.monotonic()
    fdir = tmp_path / "run" / "failures" / "1"
    _wait_for(fdir / "rank-1.txt", sup)
    # released only now: continued for its stack dump (until the dump is whole) it would
    # otherwise train on with rank 0, and could finish the epoch before the kill; the
    # relaunch passes the hold at once
    (hold / "released").touch()
    _wait_for(fdir / "rank-0.txt", sup)
    assert time.monotonic() - stopped < timeout_s + 2 + 10  # the beat interval + the poll
    out, err = sup.communicate(timeout=180)
    assert sup.returncode == 0, err[-4000:]
    stuck = (fdir / "rank-1.txt").read_text()
    assert "_index_worker.py" in stuck and "in step" in stuck, stuck  # where it was stopped
    assert "File " in (fdir / "rank-0.txt").read_text()  # the peer, waiting in a collective
    failure, *rest = _events(tmp_path)
    assert failure["kind"] == "hang" and failure["ranks"] == [1], failure
    assert [e["event"] for e in rest] == ["restart", "completed"]
    assert "hang: no progress" in err


def test_the_same_error_on_every_rank_ends_without_restart(tmp_path: Path) -> None:
    spec = _spec(tmp_path, fail_step=2, hold=None)
    sup = _start(tmp_path, spec, "--hang-timeout-s", "60", "--max-restarts", "3")
    out, err = sup.communicate(timeout=180)
    assert sup.returncode != 0
    events = _events(tmp_path)
    assert [e["event"] for e in events] == ["failure", "stopped"], events
    assert "every rank raised the same error" in events[0]["why"]
    assert "ValueError: the same error on every rank" in events[0]["why"]
    assert not (tmp_path / "run" / "supervise-attempt-2.log").exists()
    assert "not restarting" in err
    times = [e["t"] for e in events]  # epoch seconds, what bench/recovery.py splits by
    assert all(isinstance(t, float) for t in times) and times == sorted(times), events


def test_a_launcher_exit_is_seen_at_once_not_at_the_next_poll(tmp_path: Path) -> None:
    """The watch loop wakes on the launcher's exit: with a 60 s poll interval a crash
    is still recorded at once (a fixed sleep would hold it for the whole interval)."""
    start = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp.supervise",
            "--run-dir",
            str(tmp_path),
            "--poll-s",
            "60",
            "--max-restarts",
            "0",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(0.5); exit(1)",
        ],
        env=_launch.base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    assert time.monotonic() - start < 30, "the exit waited for the poll interval"
    assert [e["event"] for e in _events_in(tmp_path)] == ["failure", "stopped"]


def test_no_launcher_command_is_one_line_exit_2() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "ddp.supervise", "--hang-timeout-s", "5"],
        env=_launch.base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("supervise: error: no launcher command")


def _sup(tmp: Path, code: str) -> subprocess.CompletedProcess:
    """The supervisor around a plain Python 'launcher' that fails as ``code`` says."""
    cmd = [
        sys.executable,
        "-m",
        "ddp.supervise",
        "--run-dir",
        str(tmp),
        "--poll-s",
        "0.05",
        "--max-restarts",
        "3",
        "--",
        sys.executable,
        "-c",
        code,
    ]
    return subprocess.run(cmd, env=_launch.base_env(), capture_output=True, text=True, timeout=120)


def test_enospc_and_config_errors_are_not_node_failures(tmp_path: Path) -> None:
    full = _sup(tmp_path / "a", "print('OSError: [Errno 28] No space left on device'); exit(1)")
    assert full.returncode == 1
    events = _events_in(tmp_path / "a")
    assert [e["event"] for e in events] == ["failure", "stopped"] and "ENOSPC" in events[0]["why"]
    config = _sup(
        tmp_path / "b",
        "import sys; print('ddp: error: rank 0 failed: bad key', file=sys.stderr); exit(2)",
    )
    assert config.returncode == 2
    assert "configuration error" in _events_in(tmp_path / "b")[0]["why"]
    # a plain crash is taken for a node failure: relaunched up to --max-restarts
    crash = _sup(tmp_path / "c", "import os; os.kill(os.getpid(), 9)")
    assert crash.returncode != 0
    assert [e["event"] for e in _events_in(tmp_path / "c")].count("restart") == 3


def _events_in(run: Path) -> list[dict]:
    return json.loads((run / "run.json").read_text())["supervisor"]["events"]


def _attempts(path: Path) -> list[list[tuple[int, list[int]]]]:
    """One rank's log split where the step goes back (a relaunch): [(step, ids)] each."""
    runs: list[list[tuple[int, list[int]]]] = [[]]
    for line in path.read_text().splitlines():
        _epoch, step, *ids = map(int, line.split())
        if runs[-1] and step <= runs[-1][-1][0]:
            runs.append([])
        runs[-1].append((step, ids))
    return runs


def epoch_once_without_rank_1(seen: Path) -> int:
    """The check every lost-node test makes of ``_index_worker``'s logs: rank 1 ran one
    attempt, rank 0 two (the relaunch alone), and the epoch's every sample was trained
    exactly once: both ranks' steps up to the checkpoint the relaunch resumed from, then
    the relaunch's. Returns that checkpoint's step."""
    r0, r1 = _attempts(seen / "0.txt"), _attempts(seen / "1.txt")
    assert len(r0) == 2 and len(r1) == 1, (r0, r1)  # rank 1's node never ran again
    resumed = r0[1][0][0] - 1
    kept = [ids for att in (r0[0], r1[0]) for step, ids in att if step <= resumed]
    kept += [ids for _step, ids in r0[1]]
    assert sorted(i for ids in kept for i in ids) == list(range(N))
    return resumed


def _supervised_two_nodes(
    slurm_cluster, tmp_path: Path, supervise: str, sig: int, release: bool = True
) -> str:
    """Submit a 2-node job (one rank a node) under ``ddp.supervise SUPERVISE -- srun``,
    wait until rank 1 (on n2, which shares this host) holds before step 4, send it
    ``sig`` and (``release``) let it go on; the job's id."""
    hold = tmp_path / "hold"
    hold.mkdir()
    spec = _spec(tmp_path, hold={"rank": 1, "step": 4, "dir": str(hold)})
    script = tmp_path / "job.sh"
    script.write_text(
        "\n".join(
            [
                "#!/bin/bash",
                "#SBATCH -N 2",
                "#SBATCH --ntasks-per-node=1",
                "#SBATCH --no-kill",
                "set -eu",
                f"export PYTHONPATH={_launch.ROOT / 'src'}:{_launch.ROOT}",
                # a free port: the default is derived from the job id, which every private test
                # cluster starts at 1, so another test process's job may hold it
                f"export OMP_NUM_THREADS=1 MASTER_PORT={free_port()}",
                f"{sys.executable} -m ddp.supervise --run-dir {tmp_path / 'run'} {supervise} "
                f"-- srun --kill-on-bad-exit=1 {sys.executable} "
                f"{_launch.ROOT / WORKER} {shlex.quote(json.dumps(spec))}",
            ]
        )
        + "\n"
    )
    job = slurm_cluster.submit(script)
    deadline = time.monotonic() + 120
    while not (hold / "ready").exists():
        assert slurm_cluster.state(job) in ("PENDING", "RUNNING"), slurm_cluster.job_log(job)
        assert time.monotonic() < deadline, slurm_cluster.job_log(job)
        time.sleep(0.05)
    os.kill(int((hold / "ready").read_text()), sig)
    if release:
        (hold / "released").touch()  # a stopped rank sees it only once continued
    return job


@pytest.mark.slurm
def test_slurm_node_lost_relaunches_alone_on_the_other(slurm_cluster, tmp_path: Path) -> None:
    """2 nodes, one rank each; n2's rank is SIGKILLed mid-epoch: srun names n2, the
    supervisor excludes it and relaunches on n1 at half the world size; the job completes
    and the epoch's every sample is trained exactly once."""
    job = _supervised_two_nodes(
        slurm_cluster,
        tmp_path,
        "--hang-timeout-s 60 --max-restarts 2 --min-nodes 1",
        signal.SIGKILL,
    )
    state = slurm_cluster.wait(job, timeout=180)
    log = slurm_cluster.job_log(job)
    assert state == "COMPLETED", log[-5000:]
    assert "excluding node(s) n2; relaunching on n1" in log
    events = _events(tmp_path)
    excl = [e for e in events if e["event"] == "exclude"]
    assert excl and excl[0]["nodes"] == ["n2"] and excl[0]["remaining"] == ["n1"], events
    assert events[-1]["event"] == "completed"
    # resumed from step 4's checkpoint at world size 1
    assert epoch_once_without_rank_1(tmp_path / "seen") == 4


@pytest.mark.slurm
def test_slurm_hung_rank_on_the_other_node_is_probed_named_and_excluded(
    slurm_cluster, tmp_path: Path
) -> None:
    """2 nodes; n2's rank is SIGSTOPped. The supervisor (on n1) cannot signal it, so a
    probe (``srun --overlap`` on n2) takes its stack, reports it stopped and kills it: n2
    alone is named and excluded, and the job completes on n1."""
    # held, not released: the probe continues rank 1 for its stack dump (and stops it
    # again once the dump is whole), and released it would train on with rank 0 meanwhile
    job = _supervised_two_nodes(
        slurm_cluster,
        tmp_path,
        "--hang-timeout-s 10 --max-restarts 1 --poll-s 0.2",
        signal.SIGSTOP,
        release=False,
    )
    state = slurm_cluster.wait(job, timeout=180)
    log = slurm_cluster.job_log(job)
    assert state == "COMPLETED", log[-5000:]
    failure = [e for e in _events(tmp_path) if e["event"] == "failure"]
    assert failure[0]["kind"] == "hang" and failure[0]["nodes"] == ["n2"], failure
    assert failure[0]["seen_t"] <= failure[0]["t"], failure  # seen, then stacks and kills
    assert "'1': 'stopped'" in failure[0]["why"] or "1: 'stopped'" in failure[0]["why"], failure
    run = tmp_path / "run"
    stuck = (run / "failures" / "1" / "rank-1.txt").read_text()
    assert "_index_worker.py" in stuck and "in step" in stuck, stuck  # taken on n2 by the probe
    assert "File " in (run / "failures" / "1" / "rank-0.txt").read_text()
    assert "excluding node(s) n2; relaunching on n1" in log
    r1 = _attempts(tmp_path / "seen" / "1.txt")
    assert len(r1) == 1, r1  # n2's rank never ran again


def test_srun_relaunch_line_names_nodes_tasks_and_exclusions(monkeypatch) -> None:
    from ddp.relaunch import srun_command, tasks_per_node

    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    line = [
        "srun",
        "--kill-on-bad-exit=1",
        "-N",
        "2",
        "--ntasks=8",
        "--cpu-bind=none",
        "python",
        "t.py",
        "-n",
        "3",
    ]
    per = tasks_per_node(line, 2)
    assert per == 4
    assert srun_command(line, ["n1"], ["n2"], per) == [
        "srun",
        "--nodes=1",
        "--ntasks=4",
        "--ntasks-per-node=4",
        "--exclude=n2",
        "--cpu-bind=none",
        "python",
        "t.py",
        "-n",
        "3",
    ]


@contextlib.contextmanager
def _stuck_rank(hb: Path, setup: str = "", stop: bool = False):
    """A process standing for a rank as collect_stacks sees one: faulthandler on SIGUSR2
    into ``hb/stack-rank-0.txt`` (as ddp.heartbeat installs it), ``setup`` (code run
    first), then a spin in ``stuck_here``; SIGSTOPped when ``stop``. Yields (the process,
    its beats); killed on the way out."""
    from ddp.supervise import _node

    code = (
        "import faulthandler, os, signal, threading, time\n"
        f"f = open({str(hb / 'stack-rank-0.txt')!r}, 'w')\n"
        "faulthandler.register(signal.SIGUSR2, file=f, all_threads=True)\n"
        + setup
        # "up" from inside stuck_here: a stop right after "up" (before the call) was
        # a stack of <module> only, one run in a few on a loaded machine
        + "def stuck_here():\n    print('up', threading.main_thread().ident, flush=True)\n"
        "    while True: time.sleep(0.01)\n"
        "stuck_here()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        up, ident = child.stdout.readline().split()
        assert up == "up"
        if stop:
            os.kill(child.pid, signal.SIGSTOP)
            _wait_stopped(child.pid, "the SIGSTOP never took")
        yield child, {0: {"pid": child.pid, "host": _node(), "thread": int(ident)}}
    finally:
        child.kill()
        child.wait()


def _wait_stopped(pid: int, why: str) -> None:
    """Until ``pid`` is stopped: a stop takes effect when the kernel delivers it."""
    from ddp.supervise import _proc_state

    deadline = time.monotonic() + 30
    while _proc_state(pid) not in ("T", "t"):
        assert time.monotonic() < deadline, why
        time.sleep(0.01)


def test_a_stopped_rank_dumps_every_thread_and_is_stopped_again(tmp_path: Path) -> None:
    """collect_stacks continues a SIGSTOPped rank so faulthandler can dump, then stops it
    again: it must not train on (or finish) before the kill, which for a rank on another
    node comes a probe's start later. The copy holds the whole dump: faulthandler writes it
    a frame at a time, and a copy (and stop) at its first bytes held 1-19 threads of 61
    here (5 runs of 5; a CI run lost the main thread's frames this way)."""
    from ddp.supervise import collect_stacks

    hb = tmp_path / "hb"
    hb.mkdir()
    # every thread 41 frames deep before "up" (a barrier), so the count below is exact
    deep = (
        "deep_enough = threading.Barrier(61)\n"
        "def deep(n):\n    if n: return deep(n - 1)\n    deep_enough.wait()\n"
        "    while True: time.sleep(0.05)\n"
        "for _ in range(60): threading.Thread(target=deep, args=(40,), daemon=True).start()\n"
        "deep_enough.wait()\n"
    )
    with _stuck_rank(hb, deep, stop=True) as (child, beats):
        states = collect_stacks(hb, tmp_path / "out", beats, int(signal.SIGUSR2))
        assert states == {0: "stopped"}
        stack = (tmp_path / "out" / "rank-0.txt").read_text()
        assert stack.count("(most recent call first)") == 61, stack[-2000:]
        assert stack.count("in deep") == 60 * 41 and "stuck_here" in stack, stack[-2000:]
        assert f"0x{beats[0]['thread']:016x}" in stack and "incomplete" not in stack
        assert not list((tmp_path / "out").glob("nccl-trace-*"))  # no recorder: not NCCL
        _wait_stopped(child.pid, "the rank runs on after its dump")


def test_a_dump_is_whole_once_it_names_the_main_thread_and_stops_growing(tmp_path: Path) -> None:
    """The rule collect_stacks waits on, clock given: nothing new, growing, lacking the main
    thread's frames, or settled for less than SETTLE_S is not whole."""
    from ddp.supervise_evidence import SETTLE_S, _Dump, _main_thread_id

    f = tmp_path / "stack-rank-0.txt"
    f.write_bytes(b"old dump\n")
    need = _main_thread_id({"thread": 0x7F12})
    assert need == "0x0000000000007f12" and _main_thread_id({"thread": True}) == ""
    d = _Dump(f, len(b"old dump\n"), appended=True, need=need)
    assert not d.whole(0.0)  # nothing new yet
    with open(f, "ab") as fh:
        fh.write(b"Thread 0x00000000000000aa (most recent call first):\n")
    assert not d.whole(1.0) and not d.whole(1.0 + 2 * SETTLE_S)  # no main thread yet
    with open(f, "ab") as fh:
        fh.write(b"\nCurrent thread 0x0000000000007f12 (most recent call first):\n")
    assert not d.whole(5.0)  # grew: settles from now
    assert not d.whole(5.0 + SETTLE_S / 2)
    assert d.whole(5.0 + SETTLE_S + 0.01)
    assert d.new_part().startswith(b"Thread 0x") and b"old dump" not in d.new_part()
    many = _Dump(f, f.stat().st_size, appended=True, need=need)
    with open(f, "ab") as fh:  # faulthandler's cut after 100 threads: no main thread
        fh.write(b"Thread 0x00000000000000bb (most recent call first):\n  File x\n\n...\n")
    assert not many.whole(7.0) and many.whole(7.0 + SETTLE_S + 0.01)
    trace = tmp_path / "nccl-trace-rank-0"
    t = _Dump(trace, 0, appended=False)
    assert not t.whole(0.0)  # not written
    trace.write_text("entries")
    assert not t.whole(1.0) and t.whole(1.0 + SETTLE_S + 0.01)


def test_a_hang_collects_the_nccl_flight_recorder_through_its_pipe(tmp_path: Path) -> None:
    """The rank below stands for ProcessGroupNCCL (no GPU here): as its ``DumpPipe`` does,
    it makes the FIFO ``STEM<rank>.pipe`` and, from a thread other than the hung main one,
    writes ``STEM<rank>`` when anything is written to it. collect_stacks pokes the pipe and
    copies the dump beside the stacks (a rank without a pipe, not NCCL, gets no file: the
    test above)."""
    from ddp.supervise import FR_STEM, _proc_state, collect_stacks, flight_recorder_env

    hb = tmp_path / "hb"
    hb.mkdir()
    env = flight_recorder_env(hb)
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    stem = env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"]
    assert stem == str(hb / FR_STEM) and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    recorder = (
        f"stem = {stem!r}\n"
        "os.mkfifo(stem + '0.pipe')\n"
        # open for reading before "up", non-blocking, as DumpPipe does: a reader that
        # opened later let the supervisor's write fail (ENXIO) on a loaded machine
        "fd = os.open(stem + '0.pipe', os.O_RDONLY | os.O_NONBLOCK)\n"
        "def poll():\n"
        "    try: return os.read(fd, 1)\n"
        "    except BlockingIOError: return b''\n"
        "def watchdog():\n"
        "    while not poll(): time.sleep(0.01)\n"
        "    with open(stem + '0', 'w') as out: out.write('entries: all_reduce seq 7')\n"
        "threading.Thread(target=watchdog, daemon=True).start()\n"
    )
    with _stuck_rank(hb, recorder) as (child, beats):
        states = collect_stacks(hb, tmp_path / "out", beats, int(signal.SIGUSR2), wait_s=5)
        assert states[0] == "running"
        assert (tmp_path / "out" / f"{FR_STEM}0").read_text() == "entries: all_reduce seq 7"
        assert "stuck_here" in (tmp_path / "out" / "rank-0.txt").read_text()
        # a running rank is left running: under NCCL the other ranks' watchdogs poll the
        # store rank 0 serves before they read their recorder pipes
        assert _proc_state(child.pid) not in ("T", "t")


def test_a_pid_reused_by_another_process_is_never_signalled(tmp_path: Path) -> None:
    """A rank's beat names its process by pid and start time: once the rank is gone and
    its pid names another process (the start differs), the supervisor reports the rank
    gone and neither stops, asks for stacks nor kills that process."""
    from ddp.supervise import _exited, _kill_ranks, _node, _proc_state, collect_stacks
    from hpc_ddp.procs import process_start

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start(other.pid)
        assert start is not None
        beat = {"pid": other.pid, "start": start + 1, "host": _node(), "rank": 0}
        states = collect_stacks(tmp_path / "hb", tmp_path / "out", {0: beat}, int(signal.SIGUSR2))
        assert states == {0: "gone"} and _exited(beat)
        _kill_ranks({0: beat})
        assert other.poll() is None and _proc_state(other.pid) not in ("T", "t")  # untouched
        mine = {**beat, "start": start}  # the same process: found and asked for stacks
        assert not _exited(mine)
        _kill_ranks({0: mine})
        assert other.wait(timeout=30) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


def test_a_recorder_that_never_answers_costs_the_stack_nothing(tmp_path: Path) -> None:
    """A flight-recorder pipe is read by nobody's watchdog (it hangs too): the stopped
    rank is still stopped again once its stack dump is whole, its recorder is not waited
    for, and the whole dump is not marked incomplete; no recorder file is copied. Without
    a folder for the evidence the rank is asked and restored all the same."""
    from ddp.supervise import FR_STEM, _proc_state, collect_stacks

    hb = tmp_path / "hb"
    hb.mkdir()
    pipe = str(hb / (FR_STEM + "0.pipe"))
    silent = f"os.mkfifo({pipe!r})\nfd = os.open({pipe!r}, os.O_RDONLY | os.O_NONBLOCK)\n"
    with _stuck_rank(hb, silent, stop=True) as (child, beats):
        t0 = time.monotonic()
        states = collect_stacks(hb, tmp_path / "out", beats, int(signal.SIGUSR2), wait_s=120)
        # not the whole wait: stopped again, its recorder's dump cannot come, and is not
        # waited for (the bound is only against that wait)
        assert time.monotonic() - t0 < 60
        assert states == {0: "stopped"}
        stack = (tmp_path / "out" / "rank-0.txt").read_text()
        assert "stuck_here" in stack and "incomplete" not in stack, stack
        assert not list((tmp_path / "out").glob(FR_STEM + "*"))
        assert _proc_state(child.pid) in ("T", "t")
        # no folder for the evidence (here a file is in its way): no traceback, and the
        # rank is still asked and left as it was found, for the kill that comes next
        blocked = tmp_path / "blocked"
        blocked.write_text("not a folder")
        assert collect_stacks(hb, blocked, beats, int(signal.SIGUSR2)) == {0: "stopped"}
        _wait_stopped(child.pid, "the rank runs on")
        assert blocked.read_text() == "not a folder"


def test_a_rank_that_ended_unreaped_is_gone_and_never_asked(tmp_path: Path) -> None:
    """A zombie (its parent has not reaped it) is a rank that ended: "gone", blamed, and
    no signal or wait is spent on it; a beat's fields of the wrong type name no process."""
    from ddp.supervise import _node, _proc_state, _rank_state, collect_stacks

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _proc_state(child.pid) != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        beat = {"pid": child.pid, "host": _node()}
        sig = int(signal.SIGUSR2)
        assert collect_stacks(tmp_path / "hb", tmp_path / "out", {0: beat}, sig) == {0: "gone"}
        assert not (tmp_path / "out" / "rank-0.txt").exists()
        assert _rank_state({"pid": True}) is None and _rank_state({"pid": "1"}) is None
        me = {"pid": os.getpid(), "start": True}  # not a number: the pid alone decides
        assert _rank_state(me) not in (None, "Z")
    finally:
        child.wait()
