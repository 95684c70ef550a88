"""``hpc submit --sweep``, ``hpc status`` of a sweep, ``hpc logs -f`` and ``hpc report``
through the CLI (fake sbatch/squeue where a scheduler is needed; the real ones run in
tests/test_e2e_sweep.py and tests/test_e2e_pbs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.cli import main
from tests.hpc.conftest import REPO
from tests.support.polling import wait_until


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpc: error: "), lines
    return lines[0]


@pytest.mark.parametrize(("flags", "expected"), [
    (["--sweep", "optim.lr"], "optim.lr"),
    (["--sweep", "optim.lr=0.1,,0.2"], "optim.lr"),
    (["--sweep", "optim.lr=0.1"], "one task"),
    (["--sweep", "optim.lr=0.1,0.2", "--max-parallel", "3"], "--max-parallel"),
    (["--sweep", "optim.lr=0.1,0.2", "--max-parallel", "0"], "--max-parallel"),
    (["--max-parallel", "2"], "only with --sweep"),
    (["--sweep", "a=1,2", "--sweep", "a=3,4"], "a"),
    (["--sweep", "nodes=1,2"], "nodes is the job's own"),
])
def test_bad_sweeps_are_one_line_and_write_nothing(
    flags: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["submit", "--cluster", "slurm", "--runs-dir", "runs", *flags, "--", "python", "t.py"]
    assert main(argv) == 2
    assert expected in _error(capsys)
    assert not (tmp_path / "runs").exists()


def test_sweep_submits_one_array_and_records_its_tasks(
    fake_bin, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_bin("sbatch", 'echo "91"')
    monkeypatch.chdir(tmp_path)
    argv = ["submit", "--cluster", "slurm", "--runs-dir", "runs", "--sweep", "optim.lr=1e-3,1e-2",
            "--sweep", "training.batch_size=8,16", "--max-parallel", "2", "--", "python", "t.py"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == "91"
    assert fake_bin.log.read_text().count("sbatch") == 1  # one array, not four jobs
    (run,) = (tmp_path / "runs").iterdir()
    script = (run / "job.slurm").read_text()
    assert "#SBATCH --array=0-3%2\n" in script and "/%x-%A_%a.out" in script
    assert '"${HPC_SWEEP_ARGS[@]}"' in script
    record = json.loads((run / "run.json").read_text())
    assert [t["label"] for t in record["sweep"]] == [
        "optim.lr=1e-3 training.batch_size=8", "optim.lr=1e-3 training.batch_size=16",
        "optim.lr=1e-2 training.batch_size=8", "optim.lr=1e-2 training.batch_size=16"]
    manifest = json.loads((run / "sweep.json").read_text())
    assert manifest["max_parallel"] == 2 and len(manifest["tasks"]) == 4

    # status: the array, then a line per task, asked by its own id
    fake_bin("squeue", 'case "$3" in 91_0) echo COMPLETED;; 91_1) echo RUNNING;; '
                       '91) echo RUNNING;; *) echo PENDING;; esac')
    assert main(["status", str(run), "--runs-dir", "runs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "91 RUNNING"
    assert lines[1:3] == ["91_0 COMPLETED optim.lr=1e-3 training.batch_size=8",
                          "91_1 RUNNING optim.lr=1e-3 training.batch_size=16"]
    assert [ln.split()[1] for ln in lines[3:]] == ["PENDING", "PENDING"]

    # --resume submits the same array again (the tasks resume from their folders)
    assert main(["submit", "--cluster", "slurm", "--runs-dir", "runs", "--resume", str(run),
                 "--", "python", "t.py"]) == 0
    assert "#SBATCH --array=0-3%2\n" in (run / "job-2.slurm").read_text()
    capsys.readouterr()
    assert main(["submit", "--cluster", "slurm", "--runs-dir", "runs", "--resume", str(run),
                 "--sweep", "x=1,2", "--", "python", "t.py"]) == 2
    assert "holds a sweep already" in _error(capsys)


def test_local_sweep_runs_each_task_in_its_folder_with_its_overrides(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text("import json, os, sys\n"
                     "json.dump(sys.argv[1:], open(os.path.join(os.environ['HPC_RUN_DIR'], "
                     "'argv.json'), 'w'))\nsys.exit(3 if sys.argv[-1] == 'a=2' else 0)\n")
    code = main(["run", "--runs-dir", "runs", "--sweep", "a=1,2,3", "--", sys.executable, str(probe)])
    assert code == 3  # the failing task's code; the task after it still ran
    (run,) = (tmp_path / "runs").iterdir()
    seen = {p.parent.name: json.loads(p.read_text()) for p in run.glob("*/argv.json")}
    assert seen == {"000-a-1": ["--set", "a=1"], "001-a-2": ["--set", "a=2"],
                    "002-a-3": ["--set", "a=3"]}


def test_logs_follow_a_running_local_job_ends_with_its_exit_code(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}:{REPO}")
    gate = tmp_path / "go"
    body = f"echo first; while [ ! -e {gate} ]; do sleep 0.1; done; echo last; exit 7"
    job = subprocess.Popen([sys.executable, "-m", "hpc", "run", "--runs-dir", "runs", "--name",
                            "j", "--", "bash", "-c", body], cwd=tmp_path, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        runs = tmp_path / "runs"
        wait_until(lambda: any(runs.glob("*/output.log")) and b"first" in
                   next(runs.glob("*/output.log")).read_bytes(), 30, "the job's first line")
        (run,) = runs.iterdir()
        follower = subprocess.Popen([sys.executable, "-m", "hpc", "logs", "-f", str(run),
                                     "--runs-dir", "runs"], cwd=tmp_path, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert follower.poll() is None  # still following: the job runs
        gate.touch()
        out, err = follower.communicate(timeout=60)
        assert job.wait(timeout=30) == 7
        assert out.splitlines()[:2] == ["first", "last"], (out, err)
        assert follower.returncode == 7, err
    finally:
        job.kill()
