"""Hostile and careless input, the families of issue 24 met again: words that are not
UTF-8, numbers past Python's digit limit or any machine, paths the system refuses,
labels a plot would read as math, crafted records in a run folder, a job id that names
someone else's process, a recorded exit code past 255, a closed stdout.

Each bad input is one ``hpc: error:`` line and exit 2 (or, for a reader of a run's
files, a report that carries on), never a traceback; nothing is left half-written and
no process hpc did not start is signalled."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.cli import main
from hpc_ddp.procs import process_start, process_state
from tests.hpc.conftest import REPO
from tests.hpc.test_cli import _no_account_env  # noqa: F401 - autouse fixture
from tests.support.polling import wait_until

HUGE = "9" * 5000  # past int()'s 4300 digits
LONG = "a" * 5000  # past NAME_MAX and PATH_MAX


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpc: error: "), err
    assert len(lines[0]) < 400, lines[0]
    return lines[0]


def _hpc(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        "PYTHONIOENCODING": "utf-8",  # strict, as under en_US.UTF-8
        **kw.pop("env", {}),  # type: ignore[dict-item]
    }
    return subprocess.run(
        [sys.executable, "-m", "hpc", *args],
        capture_output=True,
        text=True,
        errors="replace",
        env=env,
        timeout=120,
        **kw,  # type: ignore[call-overload]
    )


# ---- words that are not UTF-8 --------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--runs-dir", "runs", "--wrap", "never", "--", "cat", "caf\udce9.txt"],
        ["render", "--cluster", "local", "-o", "out.sh", "--", "cat", "caf\udce9.txt"],
        ["submit", "--cluster", "local", "--runs-dir", "runs", "--name", "n\udcff", "--", "true"],
    ],
    ids=["run", "render-o", "submit-name"],
)
def test_a_word_that_is_not_utf8_is_one_line_and_writes_nothing(
    argv, tmp_path, monkeypatch, capsys
):
    """Bytes that are not UTF-8 reach Python as lone surrogates; the script and the run's
    records are UTF-8 text, and the first write used to stop with a traceback and a run
    folder holding an empty job.sh."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    line = _one_line(capsys)
    assert "not UTF-8" in line and "\\x" in line, line
    assert sorted(os.listdir(tmp_path)) == []


# ---- numbers: past int()'s limit, past any machine, not ASCII --------------------------------


def test_numbers_past_pythons_digit_limit_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(f"cluster: slurm\nnodes: {HUGE}\ncommand: echo\n")
    assert main(["render", "s.yaml"]) == 2
    assert "cannot be read" in _one_line(capsys)
    assert main(["render", "--cluster", "slurm", "--nodes", HUGE, "--", "echo"]) == 2
    assert "nodes" in _one_line(capsys)


@pytest.mark.parametrize(
    "flags",
    [
        ["--nodes", "99999999999999999999999"],
        ["--ppn", "99999999999999999999"],
        ["--gpus-per-node", "999999999999999999999"],
        ["--nodes", "10000001"],
    ],
)
def test_counts_past_any_machine_are_one_line(flags, capsys):
    assert main(["render", "--cluster", "slurm", *flags, "--", "echo"]) == 2
    assert "allowed: a whole number from 1 to 10000000" in _one_line(capsys)


def test_a_walltime_in_seconds_past_what_hhmmss_says_is_one_line(tmp_path, capsys):
    spec = tmp_path / "w.yaml"
    spec.write_text("cluster: slurm\nwalltime: 9999999999999999999999999999\ncommand: echo\n")
    assert main(["render", str(spec)]) == 2
    assert "walltime" in _one_line(capsys)
    spec.write_text("cluster: slurm\nwalltime: 35999999\ncommand: echo\n")  # 9999:59:59
    assert main(["render", str(spec)]) == 0
    assert "#SBATCH --time=416-15:59:59" in capsys.readouterr().out  # SLURM: days-HH:MM:SS


def test_a_job_log_line_with_a_5000_digit_exit_code_is_no_traceback(tmp_path, monkeypatch, capsys):
    """``hpc status`` of a failed run reads its log's srun lines for the failing rank."""
    monkeypatch.chdir(tmp_path)
    line = f"srun: error: n1: task 1: Exited with exit code {HUGE}"
    code = main(
        ["run", "--runs-dir", "runs", "--wrap", "never", "--", "sh", "-c", f"echo '{line}'; exit 1"]
    )
    assert code == 1
    capsys.readouterr()
    (run,) = (tmp_path / "runs").iterdir()
    assert main(["status", str(run), "--runs-dir", "runs"]) == 0
    assert "FAILED" in capsys.readouterr().out


def test_a_runs_index_stamp_past_the_digit_limit_is_skipped(tmp_path):
    from hpc import runs_index

    (tmp_path / ".index").mkdir()
    (tmp_path / ".index" / "jobs").write_text(f"@{HUGE}\n" + '"5"\t"r1"\n')
    index = runs_index._read_index(tmp_path)
    assert index is not None and index.runs == {"5": ["r1"]}
    assert index.damaged and index.stamp == -1  # a line hpc never writes: not trusted


@pytest.mark.parametrize("rule", ["cap:\u0663", "cap:2\n", "cap:\uff12"])
def test_a_scaling_cap_takes_ascii_digits_only(rule):
    from ddp.scaling import ScalingRuleError, parse_rule

    with pytest.raises(ScalingRuleError):
        parse_rule(rule)
    assert parse_rule("cap:2").cap == 2.0


# ---- paths the system refuses ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["logs", LONG, "--rank", "1"],
        ["render", "-o", LONG, "--cluster", "local", "--", "echo"],
        ["render", "--all-jobs", "--jobs-dir", LONG],
        ["run", "--runs-dir", LONG, "--", "echo"],
        ["status", "--runs-dir", LONG, "12345"],
        ["render", "--cluster", "local", "--templates", LONG, "--", "echo"],
    ],
    ids=["logs-rank", "render-o", "all-jobs", "run", "status", "templates"],
)
def test_a_path_the_system_refuses_is_one_line(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no scheduler client is asked
    assert main(argv) == 2
    assert "File name too long" in _one_line(capsys)
    assert sorted(os.listdir(tmp_path)) == []


# ---- hpc report: labels, fingerprints and per-rank records are anyone's text ---------------


def _metrics(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')


def test_labels_a_plot_would_read_as_math_or_cannot_encode_are_drawn_as_written(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="hpc report needs the [report] extra")
    runs = [tmp_path / "$\\foo$", tmp_path / "caf\udce9", tmp_path / "_hidden"]
    for run in runs:
        _metrics(run)
    png = tmp_path / "report.png"
    assert main(["report", *map(str, runs), "-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 0
    assert "caf\\xe9" in out and "$\\foo$" in out


def test_crafted_fingerprints_and_rank_records_leave_the_report_whole(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="hpc report needs the [report] extra")
    run = tmp_path / "r"
    _metrics(run)
    (run / "env-1.json").write_text('{"software": {}, "nodes": 5, "time": 1}')
    (run / "env-2.json").write_text(
        '{"software": {"a": "\\ud800"}, "git": {"untracked": 5, "diff": "\\ud800"},'
        ' "allocation_prefixes": 5, "nodes": 7, "time": 2}'
    )
    big = "9" * 400
    (run / "ranks.jsonl").write_text(
        '{"kind": "hosts", "hosts": ["n1", "$\\\\foo$\\ud800"]}\n'
        f'{{"kind": "ranks", "step": {big}, "data": [1, 2], "compute": [1, 2]}}\n'
        f'{{"kind": "ranks", "step": 2, "data": [1, 2], "compute": [1, {big}]}}\n'
        '{"kind": "ranks", "step": 3, "data": [0.1, 0.2], "compute": [0.1, 0.2]}\n'
        f'{{"kind": "straggler", "rank": 1, "seconds_per_step": {big}, "median": 1}}\n'
    )
    png = tmp_path / "report.png"
    assert main(["report", str(run), "-o", str(png)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the console's width
    assert "0 node(s)" in out and "\\ud800" in out and "untracked: -> 5" in out, out
    assert "1 line(s) skipped" in out, out  # the 400-digit step; the compute one is inf
    assert (run / "ranks.png").stat().st_size > 0


# ---- run records: a lone surrogate, an exit code past 255, a pid that is not the job's ----


def _finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *command: str) -> Path:
    monkeypatch.chdir(tmp_path)
    main(["run", "--runs-dir", "runs", "--wrap", "never", "--", *command])
    (run,) = (tmp_path / "runs").iterdir()
    return run


def _edit(run: Path, **fields: object) -> None:
    rec = json.loads((run / "run.json").read_text())
    rec.update(fields)
    (run / "run.json").write_text(json.dumps(rec))


@pytest.mark.parametrize("code", [256, -256, 512, 10**30])
@pytest.mark.parametrize("how", [["logs", "-f"], ["status", "--watch"]])
def test_a_failed_job_never_exits_0_whatever_its_record_says(
    code, how, tmp_path, monkeypatch, capsys
):
    """A shell keeps an exit code modulo 256: a recorded 256 used to be a failed job's 0."""
    run = _finished_run(tmp_path, monkeypatch, "false")
    _edit(run, state="FAILED", exit_code=code)
    assert main([*how, str(run), "--runs-dir", "runs"]) == 1
    assert "FAILED" in capsys.readouterr().err


def test_a_killed_jobs_negative_code_is_128_plus_its_signal(tmp_path, monkeypatch):
    run = _finished_run(tmp_path, monkeypatch, "false")
    _edit(run, state="FAILED", exit_code=-9)
    assert main(["logs", "-f", str(run), "--runs-dir", "runs"]) == 137


def test_metrics_past_a_floats_range_are_watched_not_crashed_on(tmp_path, monkeypatch, capsys):
    """``math.isfinite`` of a 400-digit integer raises OverflowError."""
    run = _finished_run(tmp_path, monkeypatch, "true")
    big = "9" * 400
    (run / "metrics.jsonl").write_text(
        f'{{"kind": "train", "step": {big}, "loss": {big}, "samples_per_s": 1}}\n'
    )
    assert main(["status", "--watch", str(run), "--runs-dir", "runs"]) == 0
    assert "COMPLETED" in capsys.readouterr().err


def test_a_lone_surrogate_in_a_record_is_shown_escaped_by_the_watch(tmp_path, monkeypatch):
    run = _finished_run(tmp_path, monkeypatch, "true")
    _edit(run, supervisor={"events": [{"event": "exclude", "excluded": ["n1\ud800"]}]})
    proc = _hpc("status", "--watch", str(run), "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "n1\\ud800" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("job_id", ["local-99999999999999999999-1", "local-0-1", "local-4194305-1"])
@pytest.mark.parametrize("command", ["status", "cancel"])
def test_a_local_id_that_is_no_pid_is_one_line(job_id, command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([command, "--cluster", "local", job_id]) == 2
    assert "not running" not in _one_line(capsys)  # refused as an id, not looked up


def test_cancel_signals_no_session_leader_that_hpc_did_not_start(tmp_path, monkeypatch, capsys):
    """A run.json is anyone's file: pointed at another session leader with its very start
    time (an ssh session, a daemon), ``hpc cancel`` used to SIGTERM its whole group."""
    run = _finished_run(tmp_path, monkeypatch, "true")
    env = {k: v for k, v in os.environ.items() if k != "HPC_LOCAL_RUN"}  # a suite under hpc run
    other = subprocess.Popen(["sleep", "300"], start_new_session=True, env=env)
    try:
        _edit(run, state=None, job_id=f"local-{other.pid}-{process_start(other.pid)}")
        capsys.readouterr()
        assert main(["cancel", str(run), "--runs-dir", "runs"]) == 2
        assert "is not running" in _one_line(capsys)
        assert other.poll() is None  # never signalled
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()


def _job_id(tmp_path: Path) -> str:
    """The id ``hpc run`` recorded for the one run under ``tmp_path/runs`` ('' not yet)."""
    for rec in (tmp_path / "runs").glob("sh-*/run.json"):
        with contextlib.suppress(ValueError):  # read while it is replaced: try again
            return json.loads(rec.read_text()).get("job_id") or ""
    return ""


@pytest.mark.parametrize("how", ["exec", "leader-exited"])
def test_status_and_cancel_still_see_a_job_hpc_run_started(how, tmp_path):
    """The mark survives the script's ``exec`` of the launcher; a leader that exited (a
    zombie until ``hpc run`` reaps it, its environment unreadable) while a process of its
    group runs on is still RUNNING and cancellable through that process."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    ready = tmp_path / "ready"
    line = {
        "exec": f"touch {ready}; exec sleep 300",
        "leader-exited": f"(touch {ready}; exec sleep 300) & exit 0",
    }[how]
    job = subprocess.Popen(
        [sys.executable, "-m", "hpc", "run", "--runs-dir", "runs", "--wrap", "never", "--",
         "sh", "-c", line],
        cwd=tmp_path, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        # Both events: the job may touch `ready` before hpc has recorded its id.
        wait_until(lambda: ready.exists() and _job_id(tmp_path), 120, "the job started, recorded")
        leader = int(_job_id(tmp_path).split("-")[1])
        (run,) = (tmp_path / "runs").glob("sh-*")
        if how == "leader-exited":
            wait_until(lambda: process_state(leader, None) == "Z", 120, "the leader to exit")
        proc = _hpc("status", str(run), "--runs-dir", "runs", cwd=tmp_path)
        assert "RUNNING" in proc.stdout, proc.stdout + proc.stderr
        proc = _hpc("cancel", str(run), "--runs-dir", "runs", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


# ---- checked-in scripts, a closed stdout -------------------------------------------------------


def test_a_checked_in_script_that_is_not_utf8_is_out_of_date_not_a_traceback(tmp_path, capsys):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "a.yaml").write_text("cluster: local\ncommand: echo hi\nwrap: never\n")
    (jobs / "a.sh").write_bytes(b"\xff")
    assert main(["render", "--all-jobs", "--check", "--jobs-dir", str(jobs)]) == 2
    assert "out of date" in _one_line(capsys)
    # not recognisably hpc's (no "# Generated by hpc render"): one line, left as it is
    assert main(["render", "--all-jobs", "--jobs-dir", str(jobs)]) == 2
    assert "is not a script hpc render wrote" in _one_line(capsys)
    assert (jobs / "a.sh").read_bytes() == b"\xff"
    # hpc's own script with bytes that are not UTF-8 (damaged in place): replaced
    (jobs / "a.sh").write_bytes(b"#!/bin/bash\n# Generated by hpc render from a.yaml\n\xff\n")
    assert main(["render", "--all-jobs", "--jobs-dir", str(jobs)]) == 0
    assert (jobs / "a.sh").read_text().startswith("#!")
    assert main(["render", "--all-jobs", "--check", "--jobs-dir", str(jobs)]) == 0


def test_a_closed_stdout_is_one_line_but_hpc_run_keeps_the_output_in_its_log(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}

    def closed(args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", f"exec {sys.executable} -m hpc {args} >&-"],
            capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
        )  # fmt: skip

    proc = closed("render --cluster local -- echo hi")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("hpc: error: standard output is closed; allowed: a terminal"), line
    proc = closed("run --runs-dir runs --wrap never -- echo kept-in-the-log")
    assert proc.returncode == 0, proc.stderr
    (log,) = (tmp_path / "runs").glob("*/output.log")
    assert log.read_text() == "kept-in-the-log\n"
