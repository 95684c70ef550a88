"""Closed pipes and signals: every command line ends quietly when its reader goes away
(coreutils: no message, exit 141), and ``hpc run`` keeps its job alive, fully logged and
recorded when its own stdout goes away or it is signalled (the signal goes on to the job).

Every test runs the real entry point in a subprocess, as a shell would, and waits on
events (a file the job writes, the process exiting); the timeouts only end a true hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hpc.conftest import REPO
from tests.support.polling import wait_until
from tests.support.signals import default_signals

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
SIGPIPE_EXIT = 128 + signal.SIGPIPE
LINES = 30_000  # ~300 KB: several times what a pipe holds, so writes go on after a close
SPEW = f"for i in $(seq 1 {LINES}); do echo line $i; done"


@contextlib.contextmanager
def _no_reader() -> Iterator[int]:
    """A pipe's write end whose read end is closed already: ``| true`` without the race
    (every write to it fails, however early or late the program writes)."""
    read, write = os.pipe()
    os.close(read)
    try:
        yield write
    finally:
        os.close(write)


def _quiet_exit(argv: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with stdout a pipe nobody reads; returns it (stdout unused)."""
    with _no_reader() as out:
        proc = subprocess.run(
            argv, stdout=out, stderr=subprocess.PIPE, text=True, cwd=cwd, env=ENV, timeout=120, **kw
        )
    return proc


def _head_1(argv: list[str], cwd: Path) -> tuple[str, int, str]:
    """``argv | head -1``: the first line, then the read end closed; (line, rc, stderr)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=ENV)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline().decode()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
        _end_job(cwd)  # an `hpc run` that failed left its job
    return line, rc, err


def _hpc(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpc", *args]


def _local_run(tmp_path: Path, command: str) -> Path:
    """A finished ``hpc run`` of ``bash -c command`` in tmp_path/runs; its run directory."""
    proc = subprocess.run(
        _hpc("run", "--runs-dir", "runs", "--", "bash", "-c", command),
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (run,) = (tmp_path / "runs").iterdir()
    return run


# --- every entry point: a reader that left early is no error --------------------------


def test_hpc_logs_into_head_exits_141_without_a_traceback(tmp_path: Path) -> None:
    run = _local_run(tmp_path, SPEW)
    line, rc, err = _head_1(_hpc("logs", str(run)), tmp_path)
    assert line == "line 1\n"
    assert (rc, err) == (SIGPIPE_EXIT, "")


@pytest.mark.parametrize(
    "argv",
    [
        ["render", "--cluster", "slurm", "--queue", "debug", "--", "python", "t.py"],
        ["clusters"],  # rich's table (rich exits 1 itself on a closed pipe)
    ],
    ids=["render", "clusters"],
)
def test_hpc_with_no_reader_exits_141_and_says_nothing(argv: list[str], tmp_path: Path) -> None:
    proc = _quiet_exit(_hpc(*argv), tmp_path)
    assert (proc.returncode, proc.stderr) == (SIGPIPE_EXIT, "")


# argparse's help: argparse drops a failed write itself (then 0), or the rest fails at
# the last flush (then 141); either is quiet, as the rule allows
HELP_EXITS = (0, SIGPIPE_EXIT)


def test_hpc_help_with_no_reader(tmp_path: Path) -> None:
    proc = _quiet_exit(_hpc("render", "--help"), tmp_path)
    assert proc.returncode in HELP_EXITS and proc.stderr == "", proc.stderr


def test_hpc_logs_follow_into_head(tmp_path: Path) -> None:
    run = _local_run(tmp_path, SPEW)
    line, rc, err = _head_1(_hpc("logs", "-f", str(run)), tmp_path)
    assert (line, rc, err) == ("line 1\n", SIGPIPE_EXIT, "")


def test_hpc_sweep_shell_with_no_reader(tmp_path: Path) -> None:
    from hpc.sweep import tasks_from_flags, write_manifest

    write_manifest(tmp_path, tasks_from_flags(["optim.lr=1,2"]))
    proc = _quiet_exit(
        [sys.executable, "-m", "hpc.sweep", "shell", str(tmp_path), "--index", "1"], tmp_path
    )
    assert (proc.returncode, proc.stderr) == (SIGPIPE_EXIT, "")


@pytest.mark.parametrize(
    ("argv", "exits"),
    [
        (["ddp", "--list"], (SIGPIPE_EXIT,)),
        (["ddp.exec", "--help"], (SIGPIPE_EXIT,)),
        (["ddp", "--help"], HELP_EXITS),
        (["ddp.data", "--help"], HELP_EXITS),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_ddp_entry_points_with_no_reader(
    argv: list[str], exits: tuple[int, ...], tmp_path: Path
) -> None:
    proc = _quiet_exit([sys.executable, "-m", *argv], tmp_path)
    assert proc.returncode in exits and proc.stderr == "", proc.stderr


def test_ddp_data_prepare_with_no_reader_ends_quietly_after_its_work(tmp_path: Path) -> None:
    fasta = tmp_path / "x.fasta"
    fasta.write_text(">a\nMKV\n>b\nMKVL\n")
    proc = _quiet_exit([sys.executable, "-m", "ddp.data", "prepare-fasta", str(fasta)], tmp_path)
    assert proc.returncode == SIGPIPE_EXIT
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr, proc.stderr


def test_ddp_exec_gives_the_command_sigpipe_back(tmp_path: Path) -> None:
    """An ignored signal stays ignored across exec: ``yes`` would say 'Broken pipe' and
    exit 1 instead of ending silently as it does under a shell."""
    proc = _quiet_exit([sys.executable, "-m", "ddp.exec", "--", "yes"], tmp_path)
    assert (proc.returncode, proc.stderr) == (-signal.SIGPIPE, "")


# --- hpc run: the job outlives hpc's stdout, and its log and record stay whole ---------


def _record(tmp_path: Path) -> dict:
    (rec,) = (tmp_path / "runs").glob("*/run.json")
    return json.loads(rec.read_text())


def _end_job(tmp_path: Path) -> None:
    """Kill what a failed test left running: the job has its own session (hpc's pid is
    not the job's), recorded as ``local-PID-START``."""
    for rec in (tmp_path / "runs").glob("*/run.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, AttributeError):
            os.killpg(int(json.loads(rec.read_text())["job_id"].split("-")[1]), signal.SIGKILL)


def _log_lines(tmp_path: Path) -> list[str]:
    (log,) = (tmp_path / "runs").glob("*/output.log")
    return log.read_text().splitlines()


def test_hpc_run_into_head_keeps_the_job_alive_and_logged(tmp_path: Path) -> None:
    argv = _hpc("run", "--runs-dir", "runs", "--", "bash", "-c", SPEW)
    line, rc, err = _head_1(argv, tmp_path)
    assert line == "line 1\n"
    assert rc == 0 and "Traceback" not in err, err  # the job's own exit code
    lines = _log_lines(tmp_path)
    assert len(lines) == LINES and lines[-1] == f"line {LINES}"
    rec = _record(tmp_path)
    assert (rec["state"], rec["exit_code"]) == ("COMPLETED", 0)


def test_hpc_run_with_no_reader_from_the_start(tmp_path: Path) -> None:
    proc = _quiet_exit(
        _hpc("run", "--runs-dir", "runs", "--", "bash", "-c", f"{SPEW}; exit 4"), tmp_path
    )
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr
    assert len(_log_lines(tmp_path)) == LINES
    assert (_record(tmp_path)["state"], _record(tmp_path)["exit_code"]) == ("FAILED", 4)


def test_hpc_run_whose_log_cannot_grow_still_passes_every_line_on(tmp_path: Path) -> None:
    """The other way round: the log's disk is full (here: a file size limit), stdout is
    fine. The job must not die of SIGPIPE because hpc gave up; one line says why the
    log is short."""
    limit = 64 * 1024

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(
        _hpc("run", "--runs-dir", "runs", "--", "bash", "-c", SPEW),
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=small_files,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"line {i}" for i in range(1, LINES + 1)]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpc:")]
    assert len(err) == 1 and "output.log" in err[0] and "File too large" in err[0], proc.stderr
    assert (_record(tmp_path)["state"], _record(tmp_path)["exit_code"]) == ("COMPLETED", 0)


# --- hpc run: signals go on to the job's process group --------------------------------

# bash runs a trap once its foreground command ends: the short sleeps bound that wait
# (a background `sleep` would ignore SIGINT and SIGQUIT, as bash starts them, and hold
# the job's output open after the trap's exit)
TRAPPER = """\
trap 'echo {name} > got; exit 7' {name}
touch ready
for i in $(seq 600); do sleep 0.1; done
echo never
"""


@pytest.mark.parametrize(
    "signum",
    [
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGUSR1,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR2,
        signal.SIGALRM,
        signal.SIGCONT,
    ],
    ids=lambda s: s.name,
)
def test_hpc_run_passes_signals_to_the_job_and_exits_with_its_status(
    signum: signal.Signals, tmp_path: Path
) -> None:
    name = signum.name.removeprefix("SIG")
    proc = subprocess.Popen(
        _hpc("run", "--runs-dir", "runs", "--", "bash", "-c", TRAPPER.format(name=name)),
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    try:
        wait_until((tmp_path / "ready").exists, 60, "the job to set its trap")
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        _end_job(tmp_path)
    assert (tmp_path / "got").read_text() == f"{name}\n"
    assert proc.returncode == 7 and "never" not in out, err
    rec = _record(tmp_path)
    assert (rec["state"], rec["exit_code"]) == ("FAILED", 7)


RECEIVER = """\
import json, os, signal, sys
from hpc.schedulers.local import Local

def started(job_id):  # the signal comes while hpc records the job's start
    os.kill(os.getpid(), signal.{name})

sub = Local().submit(sys.argv[1], sys.argv[2], on_start=started)
print(sub.exit_code)
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_while_the_start_is_recorded_reaches_the_job(name: str, tmp_path: Path) -> None:
    """hpc installed its forwarding only after recording the job's start: a signal in
    between ended hpc and left the job running with nobody reading its output."""
    script = tmp_path / "job.sh"
    script.write_text(f"echo $$ > {tmp_path / 'pid'}\nexec sleep 60\n")
    proc = subprocess.run(
        [sys.executable, "-c", RECEIVER.format(name=name), str(script), str(tmp_path)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        signum = getattr(signal, name)
        assert (proc.returncode, proc.stdout.strip()) == (0, str(128 + signum)), proc.stderr
    finally:  # the old code left `sleep 60` behind in its own session
        with contextlib.suppress(OSError, ValueError):
            os.killpg(int((tmp_path / "pid").read_text()), signal.SIGKILL)


SWEEP_TASK = """\
trap 'echo TERM > "$HPC_RUN_DIR/got"; exit 7' TERM
touch "$HPC_RUN_DIR/ready"
for i in $(seq 600); do sleep 0.1; done
"""


def test_hpc_run_of_a_sweep_stops_after_the_signalled_task_with_its_status(tmp_path: Path) -> None:
    """The sweep's loop is a shell of its own: it must let the running task answer the
    signal, start no further task, and end with that task's status (it died of the
    signal before, 143, whatever the task did)."""
    argv = _hpc(
        "run", "--runs-dir", "runs", "--sweep", "optim.lr=1,2", "--", "bash", "-c", SWEEP_TASK
    )
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until(lambda: any((tmp_path / "runs").glob("*/*/ready")), 60, "task 0 to start")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        _end_job(tmp_path)
    (ready,) = (tmp_path / "runs").glob("*/*/ready")  # task 1 never started
    assert (ready.parent / "got").read_text() == "TERM\n"
    assert proc.returncode == 7, err
    assert (_record(tmp_path)["state"], _record(tmp_path)["exit_code"]) == ("FAILED", 7)


def test_hpc_logs_follow_ends_when_its_reader_leaves_though_the_job_writes_nothing(
    tmp_path: Path,
) -> None:
    """`hpc logs -f RUN | grep -m1 started`: grep leaves at once, the job goes on
    quietly for hours; hpc must notice its reader is gone (as tail -f does) instead of
    following until the job ends."""
    job = subprocess.Popen(
        _hpc("run", "--runs-dir", "runs", "--", "bash", "-c", "echo started; sleep 600"),
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def started() -> bool:
            found = list((tmp_path / "runs").glob("*/output.log"))
            return bool(found) and "started" in found[0].read_text()

        wait_until(started, 60, "the job to start")
        (run,) = (tmp_path / "runs").iterdir()
        line, rc, err = _head_1(_hpc("logs", "-f", str(run)), tmp_path)
        assert (line, rc, err) == ("started\n", SIGPIPE_EXIT, "")
    finally:
        job.send_signal(signal.SIGTERM)  # passed on to the job: it ends
        job.wait(timeout=60)


def test_training_whose_stdout_reader_left_goes_on_quietly(tmp_path: Path) -> None:
    """`python -m ddp RECIPE | head -1`: the trainer logs to stdout; logging printed a
    traceback per record once the reader left. The run goes on quietly instead (its
    metrics and checkpoints are files: only the echo is lost) and exits 0."""
    import importlib.util

    from tests.support.parts import require

    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    argv = [
        sys.executable,
        "-m",
        "ddp",
        "gnn",
        "--max_steps",
        "6",
        "--set",
        "logging.every_n_steps=1",
        "checkpoint.dir=" + str(tmp_path / "ck"),
    ]
    proc = _quiet_exit(argv, tmp_path)  # no reader from the first line on
    err = proc.stderr
    assert proc.returncode == 0 and "Traceback" not in err and "Logging error" not in err, err
    steps = [
        json.loads(ln)["step"] for ln in (tmp_path / "ck" / "metrics.jsonl").open() if "loss" in ln
    ]
    assert steps and max(steps) == 6


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=lambda s: s.name)
def test_hpc_run_of_the_trainer_passes_the_preemption_signal_on(
    signum: signal.Signals, tmp_path: Path
) -> None:
    """The issue's case: SIGUSR1 or SIGTERM to `hpc run` of a training run. The trainer
    gets it, saves its checkpoint and exits 75; hpc records and returns that status."""
    import importlib.util

    from tests.support.parts import require

    require(importlib.util.find_spec("torch") is not None, "torch is not installed")
    ck = tmp_path / "ck"
    argv = _hpc(
        "run",
        "--runs-dir",
        "runs",
        "--",
        sys.executable,
        "-m",
        "ddp",
        "gnn",
        "--epochs",
        "100000",
        "--set",
        "logging.every_n_steps=1",
        f"checkpoint.dir={ck}",
    )
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:

        def stepping() -> bool:  # the trainer's metrics go to its run directory
            found = list((tmp_path / "runs").glob("*/metrics.jsonl"))
            return bool(found) and '"loss"' in found[0].read_text()

        wait_until(stepping, 120, "the trainer's first logged step")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
        _end_job(tmp_path)
    assert proc.returncode == 75, err
    assert list(ck.glob("step_*.pt")), "no checkpoint saved on the signal"
    rec = _record(tmp_path)
    assert (rec["state"], rec["exit_code"]) == ("FAILED", 75)
