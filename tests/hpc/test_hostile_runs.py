"""Hostile and careless input to the commands that read a run directory.

``hpc logs``, ``hpc status``, ``hpc report`` and ``python -m hpc.sweep shell`` read
files that anyone with write access to a shared file system may have changed. Each
bad input must give one line ``hpc: error: ...`` (``hpc sweep: error: ...`` inside a
job) and exit code 2, never a traceback; nothing user-given reaches a shell unquoted.
"""

from __future__ import annotations

import json
import os
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
    run = _run(
        tmp_path,
        {
            "scheduler": "slurm",
            "job_id": "6",
            "name": "t",
            "submissions": [{"job_id": "5", "name": "t"}],
        },
    )
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
    for argv in (
        [long],
        [long + "/metrics.jsonl"],
        [long, "r"],
        ["r", "-o", long],
        ["r", "-o", f"r/{long}/x.png"],
    ):
        assert main(["report", *argv]) == 2
        _one_line(capsys)


def test_times_whose_span_overflows_give_no_wall_time(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 1, "time": 1e308}\n{"step": 2, "loss": 1, "time": -1e308}\n'
    )
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
    run = _manifest(
        tmp_path / "r $(id) 'x'",
        overrides={"a": value.replace("\t", " ")},
        label="a=$(touch PWNED2)'",
    )
    script = (
        f"cd {str(tmp_path)!r} && task=$({sys.executable} -m hpc.sweep shell "
        f'"$RUN" --index 0) || exit 2\neval "$task"\n'
        'printf "%s\\0" "$HPC_RUN_DIR" "$HPC_SWEEP_LABEL" "${HPC_SWEEP_ARGS[@]}"'
    )
    env = {"PATH": "/usr/bin:/bin", "RUN": str(run), "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, check=True)
    fields = out.stdout.decode().split("\0")[:-1]
    assert fields == [
        str(run / "000-a-1"),
        "a=$(touch PWNED2)'",
        "--set",
        f"a={value.replace(chr(9), ' ')}",
    ]
    assert not list(tmp_path.rglob("PWNED*"))


@pytest.mark.parametrize("index", ["\u0663", "\uff10", "1234567", "-1"])
def test_an_index_of_other_digits_or_too_long_is_refused(index, tmp_path, capsys):
    """int() takes Arabic-Indic and full-width digits; an array index is ASCII only."""
    run = _manifest(tmp_path / "run")
    assert sweep.main(["shell", str(run), "--index", index]) == 2
    assert "0 to 999999 in ASCII digits" in _one_line(capsys, "hpc sweep: error: ")


# ---- issue 24: FIFOs, links and loops in run directories; ids in other digits ----------


def _hpc(*args: str, cwd: Path, module: str = "hpc") -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess; ``timeout`` only bounds a true hang (the bug under test)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _err_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error: " in lines[0], proc.stderr
    return lines[0]


def test_a_fifo_as_sweep_json_is_one_line_not_a_hang(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "sweep.json")
    proc = _hpc("shell", str(run), "--index", "0", cwd=tmp_path, module="hpc.sweep")
    assert proc.returncode == 2
    assert "named pipe" in _err_line(proc) and "sweep.json" in proc.stderr


def test_a_fifo_as_run_json_does_not_hang_a_lookup_by_job_id(tmp_path):
    _run(tmp_path, {"scheduler": "slurm", "job_id": "5", "name": "t"}, name="a-good")
    fifo = tmp_path / "runs" / "z-fifo"  # scanned first (newest name first)
    fifo.mkdir()
    os.mkfifo(fifo / "run.json")
    code = (
        "import sys; from pathlib import Path; from hpc import runs; "
        "print(runs.find('5', Path('runs'))[0].name)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,  # a bound against the hang under test
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO / 'src'}:{REPO}"},
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "a-good"), proc.stderr


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_the_lock_of_a_run_is_never_a_fifo_or_a_link(kind, tmp_path):
    """``hpc submit --resume`` locks ``RUN/.lock``: a FIFO there hung it in ``open``; a
    link made it create (and lock) whatever file the link named."""
    run = _run(
        tmp_path,
        {
            "scheduler": "local",
            "job_id": "local-1-2",
            "name": "t",
            "state": "COMPLETED",
            "exit_code": 0,
        },
    )
    target = tmp_path / "elsewhere"
    if kind == "fifo":
        os.mkfifo(run / ".lock")
    else:
        (run / ".lock").symlink_to(target)
    proc = _hpc(
        "submit",
        "--cluster",
        "local",
        "--runs-dir",
        "runs",
        "--resume",
        str(run),
        "--",
        "true",
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert ".lock" in _err_line(proc)
    assert not target.exists()
    assert sorted(p.name for p in run.iterdir()) == [".lock", "run.json"]  # nothing written


def test_a_symlink_loop_as_runs_dir_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for argv in (
        ["run", "--runs-dir", "loop", "--", "true"],
        ["submit", "--cluster", "slurm", "--runs-dir", "loop", "--dry-run", "--", "true"],
        ["submit", "--cluster", "pbs", "--runs-dir", "loop", "--dry-run", "--", "true"],
    ):
        assert main(argv) == 2, argv
        assert "symlink loop" in _one_line(capsys)


OTHER_DIGITS = [
    "\u0661\u0662\u0663",
    "\uff11\uff12\uff13",
    "12\uff13",
    "123_\u0663",
    "\u0661\u0662\u0663.server",
    "1\u06623[4].srv",
    "123[\u0664].srv",
    "local-\u0661-2",
    "local-1-\u0662",
]


@pytest.mark.parametrize("ident", OTHER_DIGITS)
@pytest.mark.parametrize("cluster", ["slurm", "pbs", "local"])
@pytest.mark.parametrize("command", ["status", "cancel"])
def test_a_job_id_in_other_digits_is_not_a_job_id(
    command, cluster, ident, fake_bin, tmp_path, capsys, monkeypatch
):
    """``str.isdigit``, ``\\d`` and ``int()`` take Arabic-Indic and full-width digits; no
    scheduler gives them. One line, and no client is asked (it said nothing, or 'done')."""
    for client in ("scancel", "squeue", "scontrol", "sacct", "qdel", "qstat"):
        fake_bin(client, "exit 0")
    monkeypatch.chdir(tmp_path)
    assert main([command, ident, "--cluster", cluster, "--runs-dir", "runs"]) == 2
    assert "job id" in _one_line(capsys)
    assert not fake_bin.log.exists()


@pytest.mark.parametrize("scheduler", ["slurm", "pbs", "local"])
def test_every_scheduler_id_parser_takes_ascii_digits_only(scheduler):
    from hpc import schedulers

    sched = schedulers.get(scheduler)
    for ident in OTHER_DIGITS:
        assert not sched.owns_id(ident), ident
        assert sched.split_id(ident) is None, ident
    good = {
        "slurm": ["123", "123_4"],
        "pbs": ["123.server", "123[4].server", "123[].s"],
        "local": ["local-12-34", "local-12"],
    }[scheduler]
    assert all(sched.owns_id(i) for i in good)


def test_log_names_in_other_digits_are_not_logs(tmp_path):
    """The log patterns match the ids the schedulers write: ASCII digits."""
    import re

    from hpc import schedulers

    names = ["t-\u0661\u0662.out", "\u0661\u0662.server.OU", "t.o\u0661\u0662", "output-\u0662.log"]
    for name in schedulers.names():
        for pattern in schedulers.get(name).log_patterns:
            assert not [n for n in names if re.fullmatch(pattern, n)], (name, pattern)


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_a_record_whose_job_id_is_not_its_schedulers_is_one_line(
    command, tmp_path, capsys, fake_bin
):
    fake_bin("scancel", "exit 0")
    fake_bin("squeue", "echo RUNNING")
    run = _run(tmp_path, {"scheduler": "slurm", "job_id": "\u0661\u0662\u0663", "name": "t"})
    assert main([command, str(run), "--runs-dir", str(tmp_path / "runs")]) == 2
    line = _one_line(capsys)
    assert "run.json" in line and "job_id" in line
    assert not fake_bin.log.exists()


# ---- user text through rich (hpc/cli.py's console, hpc/report.py) ------------------------


def test_profile_and_queue_names_with_brackets_print_as_they_are(tmp_path, capsys, monkeypatch):
    """A user's profile named ``[bold]w`` printed as markup before (bold ``w``); a queue
    named ``[/x]`` raised MarkupError, and is now refused at load (it reaches a directive)."""
    (tmp_path / "[bold]w.yaml").write_text(
        'scheduler: slurm\nppn: 1\nqueues:\n  "q":\n    nodes: 1-2\n'
    )
    monkeypatch.setenv("HPC_DDP_CLUSTERS", str(tmp_path))
    assert main(["clusters"]) == 0
    out = capsys.readouterr().out
    assert "│ [bold]w " in out and "q 1-2" in out


def test_doctor_prints_a_path_with_brackets_as_it_is(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = Path("b[/x]")  # the folder x] in the folder b[; relative, so the cell is short
    folder.mkdir(parents=True)
    (folder / "qsub").write_text("#!/bin/sh\n")
    (folder / "qsub").chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
    assert main(["doctor", "--no-torch"]) == 0
    assert "│ b[/x]/qsub " in capsys.readouterr().out


# ---- what a submission reads and writes besides the run directory ------------------------


def test_git_file_names_that_are_not_utf8_do_not_stop_a_submission(tmp_path):
    """With ``core.quotepath=false`` git prints a Latin-1 file name as its raw bytes."""
    from hpc import runs

    def git(*args: str) -> None:
        subprocess.run(
            ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            timeout=60,
        )

    git("init", "-q")
    git("config", "core.quotepath", "false")
    name = os.fsdecode(b"caf\xe9")
    (tmp_path / name).write_text("1")
    git("add", "--", name)
    git("commit", "-q", "-m", "x")
    (tmp_path / name).write_text("2")
    info = runs.git_info(tmp_path)
    assert info["git_dirty"] is True and len(info["git_commit"]) == 40


@pytest.mark.parametrize("command", ["render", "report"])
def test_output_onto_a_fifo_is_refused_and_the_fifo_kept(command, tmp_path, capsys, monkeypatch):
    """write_atomic replaces only regular files (as root, ``-o /dev/null`` replaced the
    device; a FIFO here stands in for it)."""
    import stat

    monkeypatch.chdir(tmp_path)
    os.mkfifo("out")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n')
    argv = {
        "render": ["render", "--cluster", "slurm", "-o", "out", "--", "true"],
        "report": ["report", "run", "-o", "out"],
    }[command]
    assert main(argv) == 2
    assert "not a regular file" in _one_line(capsys)
    assert stat.S_ISFIFO(os.stat("out").st_mode)
