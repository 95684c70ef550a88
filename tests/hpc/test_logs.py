"""hpc logs: which file is a job's log, and following it while the job writes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc import logs, runs
from hpc.errors import UserError


def _record(run_dir: Path, scheduler: str, *job_ids: str, name: str = "train") -> None:
    """A run record whose submissions have ``job_ids``, oldest first."""
    subs = [
        {"name": name, "scheduler": scheduler, "job_id": j, "script": f"job-{i}"}
        for i, j in enumerate(job_ids)
    ]
    record = dict(subs[-1])
    if subs[:-1]:
        record["submissions"] = subs[:-1]
    runs.write_record(run_dir, record)


def _touch(path: Path, text: str = "x\n", mtime: float | None = None) -> Path:
    path.write_text(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def _error(fn, *args) -> str:
    with pytest.raises(UserError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_slurm_resubmissions_latest_or_asked(tmp_path: Path):
    _record(tmp_path, "slurm", "100", "101")
    old = _touch(tmp_path / "train-100.out", mtime=2_000_000)
    new = _touch(tmp_path / "train-101.out", mtime=1_000_000)  # latest job, older mtime
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # not a log
    assert logs.find_log(tmp_path) == new  # the record's latest job, not the newest file
    assert logs.find_log(tmp_path, "100") == old
    assert "its jobs: 100, 101" in _error(logs.find_log, tmp_path, "7")
    assert "not a job id" in _error(logs.find_log, tmp_path, "abc")
    assert "empty job id" in _error(logs.find_log, tmp_path, " ")


def test_slurm_pending_job_gives_the_path_it_will_write(tmp_path: Path):
    _record(tmp_path, "slurm", "100", "101", name="my-job")
    _touch(tmp_path / "my-job-100.out")
    assert logs.find_log(tmp_path) == tmp_path / "my-job-101.out"


def test_slurm_array_tasks(tmp_path: Path):
    _record(tmp_path, "slurm", "500")
    (tmp_path / "sweep.json").write_text("{}")
    for task, mtime in ((0, 10), (1, 30), (2, 20)):
        _touch(tmp_path / f"train-500_{task}.out", mtime=1_000_000 + mtime)
    assert logs.find_log(tmp_path) == tmp_path / "train-500_1.out"  # latest written
    assert logs.find_log(tmp_path, "500_2") == tmp_path / "train-500_2.out"
    assert logs.find_log(tmp_path, "500_7") == tmp_path / "train-500_7.out"  # not started


def test_slurm_array_not_started_waits_for_task_0(tmp_path: Path):
    _record(tmp_path, "slurm", "500")
    (tmp_path / "sweep.json").write_text("{}")
    assert logs.find_log(tmp_path) == tmp_path / "train-500_0.out"


def test_pbs_logs(tmp_path: Path):
    _record(tmp_path, "pbs", "123.pbs01", "124[].pbs01")
    first = _touch(tmp_path / "123.pbs01.OU")
    assert logs.find_log(tmp_path, "123.pbs01") == first
    assert logs.find_log(tmp_path, "123") == first
    assert logs.find_log(tmp_path) == tmp_path / "124[0].pbs01.OU"  # the array, pending
    task = _touch(tmp_path / "124[3].pbs01.OU")
    assert logs.find_log(tmp_path) == task
    assert logs.find_log(tmp_path, "124[3].pbs01") == task
    assert logs.find_log(tmp_path, "124[5]") == tmp_path / "124[5].pbs01.OU"


def test_local_logs_follow_submission_order(tmp_path: Path):
    _record(tmp_path, "local", "local-11-1", "local-12-2")
    one = _touch(tmp_path / "output.log")
    two = _touch(tmp_path / "output-2.log")
    assert logs.find_log(tmp_path) == two
    assert logs.find_log(tmp_path, "local-11-1") == one
    assert "not a job of" in _error(logs.find_log, tmp_path, "local-99-9")


def test_folder_without_record(tmp_path: Path):
    assert "no log file" in _error(logs.find_log, tmp_path)
    _touch(tmp_path / "a-1.out", mtime=1_000_000)
    newest = _touch(tmp_path / "a-2.out", mtime=1_000_100)
    assert logs.find_log(tmp_path) == newest
    assert "not a directory" in _error(logs.find_log, tmp_path / "nope")


def test_locate(tmp_path: Path):
    run = tmp_path / "train-20260101-000000"
    run.mkdir()
    _record(run, "slurm", "500")
    assert logs.locate(str(run), tmp_path) == (run, None)
    assert logs.locate(run.name, tmp_path) == (run, None)
    assert logs.locate("500", tmp_path) == (run, "500")
    assert logs.locate("500_3", tmp_path) == (run, "500_3")
    assert "neither a run directory" in _error(logs.locate, "999", tmp_path)


def test_locate_pbs_array_task(tmp_path: Path):
    run = tmp_path / "r"
    run.mkdir()
    _record(run, "pbs", "124[].pbs01")
    assert logs.locate("124[2].pbs01", tmp_path) == (run, "124[2].pbs01")


# ---- follow -----------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, time
    path, n = sys.argv[1], int(sys.argv[2])
    time.sleep(0.3)  # the follower starts before the file exists
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(f"line {i} " + "x" * (i % 50) + "\\n")
            fh.flush()
            if i % 20 == 0:
                time.sleep(0.02)
        fh.write("last line, no newline")
    """
)


@pytest.mark.timeout(60)
def test_follow_a_real_process_until_it_ends(tmp_path: Path):
    log = tmp_path / "job.out"
    n = 400
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(log), str(n)])
    out = io.StringIO()
    try:
        logs.follow(log, lambda: proc.poll() is None, out, poll_s=0.01)
    finally:
        proc.kill()
        proc.wait()
    expected = "".join(f"line {i} " + "x" * (i % 50) + "\n" for i in range(n))
    assert out.getvalue() == expected + "last line, no newline"
    assert proc.returncode == 0


def _steps(*actions):
    """An ``is_running`` that performs one action per poll, then says the job ended."""
    pending = list(actions)

    def is_running() -> bool:
        if pending:
            pending.pop(0)()
            return True
        return False

    return is_running


def _append(path: Path, data: bytes):
    def act() -> None:
        with open(path, "ab") as fh:
            fh.write(data)

    return act


def test_follow_truncation_starts_over(tmp_path: Path):
    log = tmp_path / "job.out"
    out = io.StringIO()
    logs.follow(
        log,
        _steps(
            _append(log, b"one\ntwo\n"),
            lambda: log.write_bytes(b""),  # copytruncate
            _append(log, b"3\n"),
        ),
        out,
        poll_s=0,
    )
    assert out.getvalue() == "one\ntwo\n3\n"


def test_follow_rotation_prints_the_rest_of_the_old_file(tmp_path: Path):
    log = tmp_path / "job.out"
    out = io.StringIO()

    def rotate() -> None:
        _append(log, b"old tail\n")()  # written, not yet read, then moved away
        log.rename(tmp_path / "job.out.1")
        log.write_bytes(b"new 1\n")

    logs.follow(
        log, _steps(_append(log, b"old 1\n"), rotate, _append(log, b"new 2\n")), out, poll_s=0
    )
    assert out.getvalue() == "old 1\nold tail\nnew 1\nnew 2\n"


def test_follow_split_utf8_and_bad_bytes(tmp_path: Path):
    log = tmp_path / "job.out"
    out = io.StringIO()
    logs.follow(log, _steps(_append(log, b"caf\xc3"), _append(log, b"\xa9 \xff\n")), out, poll_s=0)
    assert out.getvalue() == "café \ufffd\n"


def test_follow_job_ended_without_a_log(tmp_path: Path):
    out = io.StringIO()
    start = time.monotonic()
    logs.follow(tmp_path / "never.out", _steps(lambda: None), out, poll_s=0.01)
    assert out.getvalue() == "" and time.monotonic() - start < 5


def test_follow_settles_for_lines_written_after_the_job_ended(tmp_path: Path):
    import threading

    log = tmp_path / "job.out"
    log.write_text("job output\n")
    late = threading.Timer(0.2, _append(log, b"slurmstepd: *** JOB 5 CANCELLED ***\n"))
    late.start()
    out = io.StringIO()
    try:
        logs.follow(log, lambda: False, out, poll_s=0.05, settle_s=1.0)
    finally:
        late.cancel()
    assert out.getvalue() == "job output\nslurmstepd: *** JOB 5 CANCELLED ***\n"
    out = io.StringIO()
    start = time.monotonic()
    logs.follow(log, lambda: False, out, poll_s=0.05)  # no settle: returns at once
    assert time.monotonic() - start < 0.5 and out.getvalue().endswith("CANCELLED ***\n")


def test_print_log(tmp_path: Path):
    log = _touch(tmp_path / "a.out", "done\n")
    out = io.StringIO()
    logs.print_log(log, out)
    assert out.getvalue() == "done\n"
    assert "does not exist yet" in _error(logs.print_log, tmp_path / "b.out", out)


# ---- what is not a regular file, and a log that never stops growing ----------------------

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}


def _not_a_file(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")  # endless: a reader without a bound never stops
    elif kind == "loop":
        path.symlink_to(path.name)
    else:
        path.mkdir()


@pytest.mark.parametrize("follow", [False, True], ids=["print", "follow"])
@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("fifo", "is a named pipe"),
        ("device", "is a device or socket; allowed: a regular file"),
        ("dir", "is a directory"),
        ("loop", "cannot be read"),
    ],
)
def test_a_log_that_is_not_a_regular_file_is_one_line_not_a_hang(
    kind: str, says: str, follow: bool, tmp_path: Path
) -> None:
    """A named pipe blocked `hpc logs -f` in open() forever; /dev/zero never ended."""
    run = tmp_path / "run"
    run.mkdir()
    _record(run, "local", "local-1-1")  # finished: ends at once, after one read of its log
    _not_a_file(kind, run / "output.log")
    argv = [sys.executable, "-m", "hpc", "logs", *(["-f"] if follow else []), str(run)]
    proc = subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, timeout=60
    )  # only against a true hang
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("hpc: error: logs: ") and says in line and "output.log" in line


def test_print_log_prints_what_the_log_holds_when_asked(tmp_path: Path) -> None:
    """A job that writes faster than the terminal reads would keep plain `hpc logs`
    going forever: it prints the log as it was when opened."""
    log = _touch(tmp_path / "job.out", "x" * 200_000)

    class Growing(io.StringIO):
        appended = 0

        def write(self, text: str) -> int:
            if self.appended < 1000:  # the job appends while we print (bounded: the old code)
                self.appended += 1
                with open(log, "a") as fh:
                    fh.write("y" * 65536)
            return super().write(text)

    out = Growing()
    logs.print_log(log, out)
    assert out.getvalue() == "x" * 200_000


# ---- a resumed run's earlier jobs ----------------------------------------------------------


def test_locate_finds_an_earlier_job_of_a_resumed_run(tmp_path: Path) -> None:
    slurm, pbs = tmp_path / "s", tmp_path / "p"
    slurm.mkdir()
    pbs.mkdir()
    _record(slurm, "slurm", "100", "101")
    _record(pbs, "pbs", "123.pbs01", "124.pbs01")
    assert logs.locate("100", tmp_path) == (slurm, "100")
    assert logs.locate("123.pbs01", tmp_path) == (pbs, "123.pbs01")
    assert logs.locate("123", tmp_path) == (pbs, "123")  # qsub's number alone, as for the latest
    earlier = _touch(slurm / "train-100.out", "first job\n")
    assert logs.find_log(*logs.locate("100", tmp_path)) == earlier


def test_hpc_logs_of_an_earlier_local_job(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    run = runs_dir / "r"
    run.mkdir(parents=True)
    _record(run, "local", "local-11-1", "local-12-2")
    _touch(run / "output.log", "first\n")
    _touch(run / "output-2.log", "second\n")
    argv = [sys.executable, "-m", "hpc", "logs", "local-11-1", "--runs-dir", str(runs_dir)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "first\n", "")


# ---- hpc logs -f ends with the job's own exit code (real SLURM and OpenPBS) ----------------

FAIL_3 = ["bash", "-c", "echo about to fail; exit 3"]


def _hpc(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with the environment as the fixtures left it (SLURM_CONF, PBS's PATH)."""
    env = {**os.environ, "PYTHONPATH": ENV["PYTHONPATH"]}
    return subprocess.run(
        [sys.executable, "-m", "hpc", *args], capture_output=True, text=True, env=env, timeout=240
    )  # only against a true hang


def _follow_exit(runs: Path, *submit: str) -> tuple[str, int, str]:
    """Submit, then `hpc logs -f` the run: (job id, its exit code, what it printed)."""
    sub = _hpc("submit", "--runs-dir", str(runs), *submit)
    assert sub.returncode == 0, sub.stderr
    (run,) = runs.iterdir()
    follow = _hpc("logs", "-f", str(run), "--runs-dir", str(runs))
    return sub.stdout.strip(), follow.returncode, follow.stdout + follow.stderr


@pytest.mark.slurm
def test_follow_of_a_slurm_job_exits_with_its_exit_code(slurm_cluster, tmp_path: Path) -> None:
    job_id, code, printed = _follow_exit(
        tmp_path / "runs",
        "--cluster",
        "slurm",
        "--queue",
        "debug",
        "--ppn",
        "1",
        "--walltime",
        "00:05:00",
        "--",
        *FAIL_3,
    )
    assert code == 3, printed
    assert "about to fail" in printed and "job ended: FAILED" in printed
    assert slurm_cluster.wait(job_id) == "FAILED"


@pytest.mark.pbs
def test_follow_of_a_pbs_job_exits_with_its_exit_code(openpbs, tmp_path: Path) -> None:
    from tests.support.parts import require_exe

    require_exe("mpiexec.hydra", "mpiexec.mpich")
    spec = tmp_path / "three.yaml"
    spec.write_text(
        json.dumps(
            {
                "name": "three",
                "cluster": "pbs",
                "wrap": "never",
                "launcher": "mpiexec",
                "walltime": "00:05:00",
                "command": FAIL_3,
            }
        )
    )
    job_id, code, printed = "", -1, ""
    try:
        job_id, code, printed = _follow_exit(tmp_path / "runs", str(spec))
    finally:
        openpbs.delete_all([job_id] if job_id else [])
    assert code == 3, printed
    assert "about to fail" in printed and "job ended: FAILED" in printed


# the scheduler's exit code as a shell says it, from the clients' real answers
SCONTROL = {  # `scontrol show job` of SLURM 22.05 (tests/support/slurm.py), cut to the fields
    "3": "JobId=7 JobName=wrap JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
    "ExitCode=3:0 DerivedExitCode=0:0",
    "signal": "JobId=8 JobState=FAILED Reason=NonZeroExitCode ExitCode=0:12 DerivedExitCode=0:0",
    "array": "JobId=9 ArrayJobId=9 ArrayTaskId=1 JobState=FAILED ExitCode=1:0\n\n"
    "JobId=10 ArrayJobId=9 ArrayTaskId=0 JobState=COMPLETED ExitCode=0:0",
}


@pytest.mark.parametrize(("case", "code"), [("3", 3), ("signal", 140), ("array", 1)])
def test_slurm_exit_code_from_scontrol(case: str, code: int, fake_bin) -> None:
    from hpc.schedulers import get

    fake_bin("scontrol", f"echo '{SCONTROL[case]}'")
    assert get("slurm").exit_code("7") == code


def test_slurm_exit_code_from_the_jobcomp_log_once_scontrol_forgot(fake_bin) -> None:
    from hpc.schedulers import get

    fake_bin("scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    fake_bin(
        "sacct",
        'if [ "$1" = "-c" ]; then printf "0:0\\n2:0\\n"; '  # requeued: last run
        "else echo 'Slurm accounting storage is disabled' >&2; fi",
    )
    assert get("slurm").exit_code("7") == 2
    fake_bin("sacct", "exit 1")
    assert get("slurm").exit_code("7") is None


@pytest.mark.parametrize(
    ("data", "code"),
    [
        ("failed-exit3.json", 3),
        ("shared-deleted.json", 143),
        ("shared-walltime.json", None),
        ("shared-finished.json", 0),
    ],
)
def test_pbs_exit_code_from_qstat(data: str, code: int | None, fake_bin) -> None:
    """Recorded ``qstat -x -f -F json`` answers of the real OpenPBS (tests/hpc/data/openpbs)."""
    from hpc.schedulers import get

    path = Path(__file__).with_name("data") / "openpbs" / data
    job_id = next(iter(json.loads(path.read_text())["Jobs"]))
    fake_bin("qstat", f"cat '{path}'")
    assert get("pbs").exit_code(job_id) == code


def test_status_and_follow_of_an_earlier_local_job_use_its_own_entry(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    run = runs_dir / "r"
    run.mkdir(parents=True)
    first = {
        "name": "t",
        "scheduler": "local",
        "job_id": "local-11-1",
        "script": "job.sh",
        "state": "COMPLETED",
        "exit_code": 0,
    }
    runs.write_record(
        run,
        {
            **first,
            "job_id": "local-12-2",
            "script": "job-2.sh",
            "state": "FAILED",
            "exit_code": 5,
            "submissions": [first],
        },
    )
    _touch(run / "output.log", "first\n")
    _touch(run / "output-2.log", "second\n")
    status = _hpc("status", "local-11-1", "--runs-dir", str(runs_dir))
    assert (status.returncode, status.stdout) == (0, "local-11-1 COMPLETED\n"), status.stderr
    follow = _hpc("logs", "-f", "local-11-1", "--runs-dir", str(runs_dir))
    assert (follow.returncode, follow.stdout) == (0, "first\n"), follow.stderr
    follow = _hpc("logs", "-f", str(run), "--runs-dir", str(runs_dir))
    assert (follow.returncode, follow.stdout) == (5, "second\n"), follow.stderr


@pytest.mark.parametrize(
    ("command", "out"),
    [
        ("logs", "found\n"),
        ("status", "local-11-1 UNKNOWN\n"),  # ended, no state recorded
    ],
)
def test_a_named_pipe_as_another_runs_record_does_not_hang_the_job_id_lookup(
    command: str, out: str, tmp_path: Path
) -> None:
    """Looking a job id up reads every run's record: a named pipe there waited for a
    writer forever. It is skipped like any other record that cannot be read."""
    runs_dir = tmp_path / "runs"
    for name in ("a", "z"):
        (runs_dir / name).mkdir(parents=True)
    _record(runs_dir / "a", "local", "local-11-1")
    _touch(runs_dir / "a" / "output.log", "found\n")
    os.mkfifo(runs_dir / "z" / "run.json")  # read first: newest name first
    proc = _hpc(command, "local-11-1", "--runs-dir", str(runs_dir))
    assert (proc.returncode, proc.stdout) == (0, out), proc.stderr
