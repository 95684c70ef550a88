"""Issue 10, login side: run directories, cancels, scripts and specs under careless or
hostile use. Each test is named after the issue's item it covers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hpc.cli import main
from tests.hpc.conftest import REPO
from tests.hpc.test_cli import _no_account_env, _one_error_line  # noqa: F401 - autouse fixture


# ---- item 3: cancel never signals a recycled pid --------------------------------------
def test_cancel_of_a_finished_local_run_signals_nobody(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--runs-dir", "runs", "--", "true"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    rec = json.loads((run / "run.json").read_text())
    # The pid is reused by an unrelated process that started later.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pid, start = rec["job_id"].removeprefix("local-").split("-")
        rec["job_id"] = f"local-{other.pid}-{start}"
        (run / "run.json").write_text(json.dumps(rec))
        capsys.readouterr()
        assert main(["cancel", str(run)]) == 2
        assert "is not running" in _one_error_line(capsys)
        assert other.poll() is None  # still alive: never signalled
    finally:
        other.kill()
        other.wait()


# ---- item 4: --resume keeps logs, names and history -----------------------------------
def test_resume_keeps_the_earlier_log(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--runs-dir", "runs", "--", "echo", "first"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert main(["run", "--runs-dir", "runs", "--resume", str(run), "--", "echo", "second"]) == 0
    assert (run / "output.log").read_text() == "first\n"
    assert (run / "output-2.log").read_text() == "second\n"


def test_concurrent_resumes_lose_no_submission(tmp_path, monkeypatch, fake_bin):
    counter = tmp_path / "n"
    counter.write_text("0")
    fake_bin(
        "sbatch",
        f"flock {counter} bash -c 'n=$(( $(cat {counter}) + 1 )); echo $n > {counter}; "
        'echo "Submitted batch job 10$n"\'',
    )
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--cluster", "slurm", "--runs-dir", "runs", "--", "true"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}

    def resume() -> None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "hpc",
                "submit",
                "--cluster",
                "slurm",
                "--runs-dir",
                "runs",
                "--resume",
                str(run),
                "--",
                "true",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            check=True,
        )

    threads = [threading.Thread(target=resume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec = json.loads((run / "run.json").read_text())
    ids = [rec["job_id"], *(s["job_id"] for s in rec["submissions"])]
    assert sorted(ids) == ["101", "102", "103", "104", "105"], ids
    assert len(list(run.glob("spec*.yaml"))) == 5 and len(list(run.glob("job*.slurm"))) == 5


# ---- item 8: '%' in the runs directory on SLURM ---------------------------------------
def test_percent_in_runs_dir_refused_on_slurm_before_writing(
    tmp_path, monkeypatch, capsys, fake_bin
):
    fake_bin("sbatch", "echo 'Submitted batch job 5'")
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--cluster", "slurm", "--runs-dir", "r%j", "--", "true"]) == 2
    assert "'%'" in _one_error_line(capsys)
    assert not (tmp_path / "r%j").exists()


# ---- item 11 and 18: render -o is atomic and never follows a planted link ---------------
def test_render_output_never_follows_a_planted_symlink(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "job.sh"
    os.symlink(victim, tmp_path / "job.sh.tmp")  # the old predictable temp name
    assert main(["render", "--cluster", "slurm", "-o", str(out), "--", "true"]) == 0
    assert victim.read_text() == "precious\n"
    assert out.read_text().startswith("#!")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sh", "job.sh.tmp", "victim"]


@pytest.mark.parametrize("case", ["directory", "read_only"])
def test_render_output_errors_are_one_line_and_leave_nothing(case, tmp_path, capsys):
    if case == "directory":
        target = tmp_path / "adir"
        target.mkdir()
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to mount a read-only tmpfs")
        ro = tmp_path / "ro"
        ro.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], check=True)
        target = ro / "job.sh"
    try:
        assert main(["render", "--cluster", "slurm", "-o", str(target), "--", "true"]) == 2
        _one_error_line(capsys)
        assert not list(target.parent.glob("*.tmp")) and not list(tmp_path.glob("*.tmp"))
    finally:
        if case == "read_only":
            subprocess.run(["umount", str(target.parent)], check=False)


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"cluster: slurm\ncommand: [true]\ndescription: \xff\xfe\n", "not UTF-8"),
        (b"cluster: slurm\ncommand: [true\n", "line"),
        (b"cluster: slurm\ncluster: aurora\ncommand: [true]\n", "duplicate key 'cluster'"),
        (b"cluster: slurm\nwalltime: 1:00\ncommand: [true]\n", "not a walltime"),
    ],
)
def test_bad_spec_files_are_one_line(content, expected, tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_bytes(content)
    assert main(["render", str(spec)]) == 2
    assert expected in _one_error_line(capsys)


def test_spec_that_is_a_directory_is_one_line(tmp_path, capsys):
    assert main(["render", str(tmp_path)]) == 2
    assert "is a directory" in _one_error_line(capsys)


# ---- item 17: status and cancel say what they mean --------------------------------------
@pytest.mark.parametrize("ident", ["", "  ", "1,2", "1 2"])
def test_status_refuses_empty_or_several_ids(ident, tmp_path, capsys):
    assert main(["status", ident, "--runs-dir", str(tmp_path)]) == 2
    assert "allowed: one run directory" in _one_error_line(capsys)


def test_cancel_of_an_unknown_job_reports_the_refusal(fake_bin, tmp_path, capsys):
    # What SLURM 22.05's scancel does: the error on stderr, exit status 0.
    fake_bin("squeue", "exit 0")
    fake_bin(
        "scancel",
        "echo 'scancel: error: Kill job error on job id 99999999: "
        "Invalid job id specified' >&2; exit 0",
    )
    assert main(["cancel", "99999999", "--runs-dir", str(tmp_path)]) != 0
    assert "Invalid job id" in _one_error_line(capsys)


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"scheduler": 5}'])
def test_damaged_run_record_is_one_line(content, tmp_path, capsys):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "run.json").write_text(content)
    assert main(["status", str(run), "--runs-dir", str(tmp_path)]) == 2
    assert "run.json" in _one_error_line(capsys)


def test_status_and_cancel_work_while_hpc_run_runs(tmp_path, monkeypatch):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpc", "run", "--runs-dir", "runs", "--", "sleep", "60"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        from tests.support.polling import wait_until

        rec_path: list[Path] = []

        def recorded() -> bool:
            rec_path[:] = list((tmp_path / "runs").glob("*/run.json"))
            return bool(rec_path) and json.loads(rec_path[0].read_text()).get("job_id")

        wait_until(recorded, timeout=30, what="the run to record its job id")
        run = rec_path[0].parent
        status = subprocess.run(
            [sys.executable, "-m", "hpc", "status", str(run)],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert status.returncode == 0 and status.stdout.strip().endswith("RUNNING"), status
        cancel = subprocess.run(
            [sys.executable, "-m", "hpc", "cancel", str(run)],
            env=env,
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert cancel.returncode == 0, cancel.stderr
        assert proc.wait(timeout=30) != 0
        assert json.loads((run / "run.json").read_text())["state"] == "FAILED"
    finally:
        proc.kill()
        proc.wait()


def test_hpc_run_passes_sigterm_on_to_the_whole_job(tmp_path):
    """The local job has its own session (so cancel reaches all of it); a signal to
    `hpc run` itself is passed on, and the exit is 128+N as a shell reports it."""
    import signal

    from tests.support.polling import wait_until

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpc",
            "run",
            "--runs-dir",
            "runs",
            "--",
            "bash",
            "-c",
            "sleep 60; echo never",
        ],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        records: list[Path] = []

        def started() -> bool:
            records[:] = list((tmp_path / "runs").glob("*/run.json"))
            return bool(records) and bool(json.loads(records[0].read_text()).get("job_id"))

        wait_until(started, timeout=30, what="the run to record its job id")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "never" not in out
    rec = json.loads(records[0].read_text())
    assert rec["exit_code"] == 143 and rec["state"] == "FAILED"
