"""Hostile and careless input to the commands that read a run directory.

``hpc logs``, ``hpc status``, ``hpc report`` and ``python -m hpc.sweep shell`` read
files that anyone with write access to a shared file system may have changed. Each
bad input must give one line ``hpc: error: ...`` (``hpc sweep: error: ...`` inside a
job) and exit code 2, never a traceback; nothing user-given reaches a shell unquoted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc import logs, sweep
from hpc.cli import main
from hpc.errors import UserError
from tests.hpc.conftest import REPO

DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that overflows json's recursion


def _one_line(capsys: pytest.CaptureFixture[str], prefix: str = "hpc: error: ") -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def _run(tmp_path: Path, record: object, name: str = "r1") -> Path:
    run = tmp_path / "runs" / name
    run.mkdir(parents=True)
    text = record if isinstance(record, str) else json.dumps(record)
    (run / "run.json").write_text(text)
    return run


# ---- run.json (hpc/runs.py) -------------------------------------------------------------


@pytest.mark.parametrize("command", ["logs", "status"])
def test_deeply_nested_run_record_is_one_line(command, tmp_path, capsys):
    run = _run(tmp_path, DEEP)
    assert main([command, str(run), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "run.json" in _one_line(capsys)


def test_a_deeply_nested_record_does_not_hide_other_runs_from_a_job_id(tmp_path, capsys):
    good = _run(tmp_path, {"scheduler": "slurm", "job_id": "5", "name": "t"}, name="a-good")
    (good / "t-5.out").write_text("hello from job 5\n")
    _run(tmp_path, DEEP, name="z-bad")  # scanned first (newest name first)
    assert main(["logs", "5", "--runs-dir", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out == "hello from job 5\n"


@pytest.mark.parametrize("command", ["logs", "status"])
def test_an_overlong_name_is_one_line(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "")  # no scheduler client: nothing is asked
    assert main([command, "a" * 5000, "--runs-dir", "runs"]) == 2
    _one_line(capsys)


@pytest.mark.parametrize(
    "record",
    [
        {"job_id": "5", "name": "t"},  # no scheduler
        {"scheduler": "slurm", "job_id": ["5"], "name": "t"},
        {"scheduler": "slurm", "job_id": 5.5, "name": "t"},
        {"scheduler": "slurm", "job_id": "5\n6", "name": "t"},
        {"scheduler": "local", "job_id": "local-1-2", "state": "BOGUS"},
        {"scheduler": "local", "job_id": "local-1-2", "state": ["COMPLETED"]},
        {"scheduler": "local", "job_id": "local-1-2", "state": "COMPLETED", "sweep": 5},
        {"scheduler": "slurm", "job_id": "6", "submissions": {"job_id": "5"}},
        {"scheduler": "slurm", "job_id": "6", "submissions": [{"job_id": "5"}]},
        {"scheduler": "slurm", "job_id": "6", "sweep": [{"index": 0, "label": "\x1b]0;x\x07"}]},
        {"scheduler": "slurm", "job_id": "6", "sweep": [{"index": 0, "label": None}]},
    ],
)
@pytest.mark.parametrize("command", ["logs", "status"])
def test_a_record_of_the_wrong_shape_is_one_line(command, record, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "")
    run = _run(tmp_path, record)
    argv = [command, str(run), "--runs-dir", str(tmp_path / "runs")]
    assert main(argv) == 2
    assert "run.json" in _one_line(capsys)


def test_an_earlier_submission_without_scheduler_is_one_line_when_asked_by_id(tmp_path):
    run = _run(tmp_path, {"scheduler": "slurm", "job_id": "6", "name": "t",
                          "submissions": [{"job_id": "5", "name": "t"}]})  # fmt: skip
    with pytest.raises(UserError):
        logs.find_log(run, "5")


# ---- hpc logs (hpc/logs.py) -------------------------------------------------------------


def test_a_job_name_cannot_point_the_log_outside_the_run_directory(tmp_path):
    run = _run(tmp_path, {"scheduler": "slurm", "job_id": "123", "name": "../../secret"})
    (tmp_path / "secret-123.out").write_text("SECRET\n")
    with pytest.raises(UserError) as info:
        logs.find_log(run)
    assert "name" in str(info.value) and "\n" not in str(info.value)


def test_a_log_replaced_by_a_directory_says_so(tmp_path, capsys):
    run = _run(tmp_path, {"scheduler": "slurm", "job_id": "5", "name": "t"})
    (run / "t-5.out").mkdir()
    assert main(["logs", str(run), "--runs-dir", str(tmp_path / "runs")]) == 2
    line = _one_line(capsys)
    assert "is a directory" in line and "does not exist" not in line


# ---- hpc report (hpc/report.py) ---------------------------------------------------------


def test_an_overlong_report_path_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n')
    long = "a" * 5000
    for argv in ([long], [long + "/metrics.jsonl"], [long, "r"], ["r", "-o", long],
                 ["r", "-o", f"r/{long}/x.png"]):  # fmt: skip
        assert main(["report", *argv]) == 2
        _one_line(capsys)


def test_times_whose_span_overflows_give_no_wall_time(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1, "time": 1e308}\n'
                                       '{"step": 2, "loss": 1, "time": -1e308}\n')  # fmt: skip
    assert main(["report", str(run)]) == 0
    assert "Traceback" not in capsys.readouterr().err


# ---- python -m hpc.sweep shell (hpc/sweep.py) -------------------------------------------


def _manifest(run: Path, **task_changes: object) -> Path:
    task = {"index": 0, "overrides": {"a": "1"}, "label": "a=1", "dirname": "000-a-1"}
    data = {"version": 1, "max_parallel": None, "tasks": [{**task, **task_changes}]}
    run.mkdir(parents=True, exist_ok=True)
    (run / "sweep.json").write_text(json.dumps(data))
    return run


@pytest.mark.parametrize("label", ["a\0b", "a\nb", "\x1b]0;title\x07", "a\x7fb"])
def test_a_label_with_control_characters_is_refused(label, tmp_path, capsys):
    run = _manifest(tmp_path / "run", label=label)
    assert sweep.main(["shell", str(run), "--index", "0"]) == 2
    assert "label" in _one_line(capsys, "hpc sweep: error: ")
    assert not (run / "000-a-1").exists()


@pytest.mark.parametrize("version", [True, 1.0])
def test_a_version_that_only_equals_1_is_refused(version, tmp_path, capsys):
    run = _manifest(tmp_path / "run")
    data = json.loads((run / "sweep.json").read_text())
    (run / "sweep.json").write_text(json.dumps({**data, "version": version}))
    assert sweep.main(["shell", str(run), "--index", "0"]) == 2
    assert "version" in _one_line(capsys, "hpc sweep: error: ")


@pytest.mark.parametrize("argv", [[], ["run", "x"], ["shell"], ["shell", "x", "--bogus"]])
def test_sweep_usage_errors_are_one_line(argv, capsys):
    assert sweep.main(argv) == 2
    _one_line(capsys, "hpc sweep: error: ")


def test_shell_output_evals_to_the_exact_values(tmp_path):
    """Values full of shell syntax come back from bash ``eval`` byte for byte."""
    value = "$(touch PWNED)'\"`id`;|&<>*?[]{}~#!\\ \t"
    run = _manifest(tmp_path / "r $(id) 'x'", overrides={"a": value.replace("\t", " ")},
                    label="a=$(touch PWNED2)'")  # fmt: skip
    script = (f"cd {str(tmp_path)!r} && task=$({sys.executable} -m hpc.sweep shell "
              f"\"$RUN\" --index 0) || exit 2\neval \"$task\"\n"
              'printf "%s\\0" "$HPC_RUN_DIR" "$HPC_SWEEP_LABEL" "${HPC_SWEEP_ARGS[@]}"')  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "RUN": str(run),
           "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}  # fmt: skip
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, check=True)
    fields = out.stdout.decode().split("\0")[:-1]
    assert fields == [str(run / "000-a-1"), "a=$(touch PWNED2)'", "--set",
                      f"a={value.replace(chr(9), ' ')}"]  # fmt: skip
    assert not list(tmp_path.rglob("PWNED*"))


@pytest.mark.parametrize("index", ["\u0663", "\uff10", "1234567", "-1"])
def test_an_index_of_other_digits_or_too_long_is_refused(index, tmp_path, capsys):
    """int() takes Arabic-Indic and full-width digits; an array index is ASCII only."""
    run = _manifest(tmp_path / "run")
    assert sweep.main(["shell", str(run), "--index", index]) == 2
    assert "0 to 999999 in ASCII digits" in _one_line(capsys, "hpc sweep: error: ")
