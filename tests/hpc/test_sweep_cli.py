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


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--sweep", "optim.lr"], "optim.lr"),
        (["--sweep", "optim.lr=0.1,,0.2"], "optim.lr"),
        (["--sweep", "optim.lr=0.1"], "one task"),
        (["--sweep", "optim.lr=0.1,0.2", "--max-parallel", "3"], "--max-parallel"),
        (["--sweep", "optim.lr=0.1,0.2", "--max-parallel", "0"], "--max-parallel"),
        (["--max-parallel", "2"], "only with --sweep"),
        (["--sweep", "a=1,2", "--sweep", "a=3,4"], "a"),
        (["--sweep", "nodes=1,2"], "nodes is the job's own"),
    ],
)
def test_bad_sweeps_are_one_line_and_write_nothing(
    flags: list[str],
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["submit", "--cluster", "slurm", "--runs-dir", "runs", *flags, "--", "python", "t.py"]
    assert main(argv) == 2
    assert expected in _error(capsys)
    assert not (tmp_path / "runs").exists()


def test_sweep_submits_one_array_and_records_its_tasks(
    fake_bin,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_bin("sbatch", 'echo "91"')
    monkeypatch.chdir(tmp_path)
    argv = [
        "submit",
        "--cluster",
        "slurm",
        "--runs-dir",
        "runs",
        "--sweep",
        "optim.lr=1e-3,1e-2",
        "--sweep",
        "training.batch_size=8,16",
        "--max-parallel",
        "2",
        "--",
        "python",
        "t.py",
    ]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == "91"
    assert fake_bin.log.read_text().count("sbatch") == 1  # one array, not four jobs
    (run,) = (tmp_path / "runs").iterdir()
    script = (run / "job.slurm").read_text()
    assert "#SBATCH --array=0-3%2\n" in script and "/%x-%A_%a.out" in script
    assert '"${HPC_SWEEP_ARGS[@]}"' in script
    record = json.loads((run / "run.json").read_text())
    assert [t["label"] for t in record["sweep"]] == [
        "optim.lr=1e-3 training.batch_size=8",
        "optim.lr=1e-3 training.batch_size=16",
        "optim.lr=1e-2 training.batch_size=8",
        "optim.lr=1e-2 training.batch_size=16",
    ]
    manifest = json.loads((run / "sweep.json").read_text())
    assert manifest["max_parallel"] == 2 and len(manifest["tasks"]) == 4

    # status: the array, then a line per task, all from one query of the array's id
    fake_bin(
        "squeue",
        '[ "$*" = "-h -r -t all -j 91 -o %i|%A|%T" ] || exit 1; '
        'printf "91_1|91|RUNNING\n91_0|91|COMPLETED\n91_2|91|PENDING\n'
        '91_3|91|PENDING\n"',
    )
    calls = len(fake_bin.log.read_text().splitlines())
    assert main(["status", str(run), "--runs-dir", "runs"]) == 0
    assert fake_bin.log.read_text().splitlines()[calls:] == [
        "squeue -h -r -t all -j 91 -o %i|%A|%T"
    ]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "91 RUNNING"
    assert lines[1:3] == [
        "91_0 COMPLETED optim.lr=1e-3 training.batch_size=8",
        "91_1 RUNNING optim.lr=1e-3 training.batch_size=16",
    ]
    assert [ln.split()[1] for ln in lines[3:]] == ["PENDING", "PENDING"]

    # --resume submits the same array again (the tasks resume from their folders)
    assert (
        main(
            [
                "submit",
                "--cluster",
                "slurm",
                "--runs-dir",
                "runs",
                "--resume",
                str(run),
                "--",
                "python",
                "t.py",
            ]
        )
        == 0
    )
    assert "#SBATCH --array=0-3%2\n" in (run / "job-2.slurm").read_text()
    capsys.readouterr()
    assert (
        main(
            [
                "submit",
                "--cluster",
                "slurm",
                "--runs-dir",
                "runs",
                "--resume",
                str(run),
                "--sweep",
                "x=1,2",
                "--",
                "python",
                "t.py",
            ]
        )
        == 2
    )
    assert "holds a sweep already" in _error(capsys)


def test_local_sweep_runs_each_task_in_its_folder_with_its_overrides(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "json.dump(sys.argv[1:], open(os.path.join(os.environ['HPC_RUN_DIR'], "
        "'argv.json'), 'w'))\nsys.exit(3 if sys.argv[-1] == 'a=2' else 0)\n"
    )
    code = main(
        ["run", "--runs-dir", "runs", "--sweep", "a=1,2,3", "--", sys.executable, str(probe)]
    )
    assert code == 3  # the failing task's code; the task after it still ran
    (run,) = (tmp_path / "runs").iterdir()
    seen = {p.parent.name: json.loads(p.read_text()) for p in run.glob("*/argv.json")}
    assert seen == {
        "000-a-1": ["--set", "a=1"],
        "001-a-2": ["--set", "a=2"],
        "002-a-3": ["--set", "a=3"],
    }


def test_logs_follow_a_running_local_job_ends_with_its_exit_code(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}:{REPO}")
    gate = tmp_path / "go"
    body = f"echo first; while [ ! -e {gate} ]; do sleep 0.1; done; echo last; exit 7"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpc",
            "run",
            "--runs-dir",
            "runs",
            "--name",
            "j",
            "--",
            "bash",
            "-c",
            body,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        runs = tmp_path / "runs"
        wait_until(
            lambda: (
                any(runs.glob("*/output.log"))
                and b"first" in next(runs.glob("*/output.log")).read_bytes()
            ),
            30,
            "the job's first line",
        )
        (run,) = runs.iterdir()
        follower = subprocess.Popen(
            [sys.executable, "-m", "hpc", "logs", "-f", str(run), "--runs-dir", "runs"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        assert follower.poll() is None  # still following: the job runs
        gate.touch()
        out, err = follower.communicate(timeout=60)
        assert job.wait(timeout=30) == 7
        assert out.splitlines()[:2] == ["first", "last"], (out, err)
        assert follower.returncode == 7, err
    finally:
        job.kill()


# ---- issue 24: a sweep's tasks never share a checkpoint folder; --resume --sweep ---------

SHARED = "/scratch/shared-ck"


@pytest.mark.parametrize(
    ("sweeps", "command", "named"),
    [
        (
            ["optim.lr=0.1,0.2"],
            ["python", "-m", "ddp", "dpo", "--set", f"checkpoint.dir={SHARED}"],
            f"checkpoint.dir={SHARED} (the command)",
        ),
        (
            ["optim.lr=0.1,0.2"],
            ["python", "-m", "ddp", "dpo", f"--set=checkpoint.dir={SHARED}"],
            f"checkpoint.dir={SHARED}",
        ),
        (
            ["optim.lr=0.1,0.2"],
            ["python", "-m", "ddp", "dpo", "--set", "optim.lr=1", f"checkpoint.dir='{SHARED}'"],
            f"checkpoint.dir='{SHARED}'",
        ),
        (
            ["optim.lr=0.1,0.2"],
            ["bash", "-c", f"python -m ddp dpo --set checkpoint.dir={SHARED}"],
            f"checkpoint.dir={SHARED}",
        ),
        (
            ["optim.lr=0.1,0.2"],
            ["python", "t.py", "--set", "checkpoint.dir=../shared"],
            "checkpoint.dir=../shared",
        ),
        (
            ["checkpoint.dir=/a,/b", "optim.lr=0.1,0.2"],
            ["python", "t.py"],
            "checkpoint.dir=/a (its --sweep values)",
        ),
    ],
)
def test_a_sweep_whose_tasks_would_share_a_checkpoint_folder_is_refused(
    sweeps: list[str],
    command: list[str],
    named: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Task 1 resumed task 0's checkpoint, trained 0 steps and was COMPLETED."""
    monkeypatch.chdir(tmp_path)
    flags = [f for s in sweeps for f in ("--sweep", s)]
    for argv in (["submit", "--cluster", "slurm", "--dry-run"], ["run"]):
        assert main([*argv, "--runs-dir", "runs", *flags, "--", *command]) == 2
        line = _error(capsys)
        assert named in line and "tasks 0 and 1" in line and "same checkpoint folder" in line
        assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("sweeps", "sets"),
    [
        (["optim.lr=0.1,0.2"], []),
        (["optim.lr=0.1,0.2"], ["checkpoint.dir=ck"]),  # relative: inside each task's folder
        (["optim.lr=0.1,0.2"], ["checkpoint.dir=null"]),  # no checkpoints at all
        (["optim.lr=0.1,0.2"], ["checkpoint.dir="]),
        (["checkpoint.dir=/a,/b"], [f"checkpoint.dir={SHARED}"]),  # the sweep's values win
    ],
)
def test_a_sweep_with_a_checkpoint_folder_per_task_is_submitted(
    sweeps: list[str],
    sets: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    flags = [f for s in sweeps for f in ("--sweep", s)]
    command = ["python", "-m", "ddp", "dpo", *(["--set", *sets] if sets else [])]
    argv = ["submit", "--cluster", "slurm", "--dry-run", "--runs-dir", "runs", *flags, "--"]
    assert main([*argv, *command]) == 0, capsys.readouterr().err


def test_resume_of_a_run_that_was_no_sweep_refuses_a_sweep(
    fake_bin,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It submitted an array whose every task exited 2 (no sweep.json to read)."""
    fake_bin("sbatch", 'echo "91"')
    monkeypatch.chdir(tmp_path)
    base = ["submit", "--cluster", "slurm", "--runs-dir", "runs"]
    assert main([*base, "--", "python", "t.py"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    before = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    assert (
        main([*base, "--resume", str(run), "--sweep", "optim.lr=0.1,0.2", "--", "python", "t.py"])
        == 2
    )
    line = _error(capsys)
    assert "was not a sweep" in line and "--resume alone" in line
    assert sorted(p.name for p in run.iterdir()) == before
    assert fake_bin.log.read_text().count("sbatch") == 1


def test_resume_of_a_sweep_whose_manifest_is_gone_is_refused(
    fake_bin,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The record still lists the tasks: resubmitting it as one plain job would run the
    command without any task's overrides."""
    fake_bin("sbatch", 'echo "91"')
    monkeypatch.chdir(tmp_path)
    base = ["submit", "--cluster", "slurm", "--runs-dir", "runs"]
    assert main([*base, "--sweep", "optim.lr=0.1,0.2", "--", "python", "t.py"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    (run / "sweep.json").unlink()
    capsys.readouterr()
    assert main([*base, "--resume", str(run), "--", "python", "t.py"]) == 2
    assert "sweep.json" in _error(capsys) and not (run / "job-2.slurm").exists()


def test_a_local_sweep_sharing_a_folder_by_recipe_flag_fails_each_task_in_one_line(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue's case with the seed guides' ``--output_dir``, which only the trainer
    knows sets checkpoint.dir: task 1 resumed task 0's final checkpoint and trained 0
    steps ("max_steps=4 already reached"), COMPLETED. Now each task stops with one line."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    shared = tmp_path / "ck"
    code = main(
        [
            "run",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--sweep",
            "optim.lr=0.002,0.02",
            "--",
            sys.executable,
            "-m",
            "ddp",
            "uniref50",
            "--config",
            "configs/uniref50.yaml",
            "--output_dir",
            str(shared),
            "--set",
            "training.max_steps=2",
            "logging.every_n_steps=1",
        ]
    )
    out = capfd.readouterr().out
    assert code == 2, out
    errors = [ln for ln in out.splitlines() if ln.startswith("ddp: error: checkpoint.dir")]
    assert len(errors) == 2 and all(str(shared) in ln for ln in errors), out
    assert "resuming from" not in out and not shared.exists()
