"""``hpc status`` of a 1,000-task sweep asks the real scheduler at most twice (issue 28).

On the real SLURM (the test cluster) and the real OpenPBS server, each scheduler client
is replaced on PATH by a wrapper that logs the call and runs the real one. The sweep's
array is submitted held (``#SBATCH --hold``, ``#PBS -h``: the spec's directives), so
no task ever runs; it is queried, then cancelled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASKS = 1000
SWEEP = "x=" + ",".join(str(i) for i in range(TASKS))


def _wrappers(where: Path, clients: list[str], path: str) -> tuple[str, Path]:
    """PATH with a logging wrapper first for each client; the log file."""
    where.mkdir()
    log = where / "calls.log"
    for name in clients:
        real = shutil.which(name, path=path)
        assert real, f"{name} not on PATH"
        wrapper = where / name
        wrapper.write_text(f'#!/bin/bash\necho "{name} $*" >> "{log}"\nexec "{real}" "$@"\n')
        wrapper.chmod(0o755)
    return f"{where}{os.pathsep}{path}", log


def _hpc(*args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    if path is not None:
        env["PATH"] = path
    proc = subprocess.run(
        [sys.executable, "-m", "hpc", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"hpc {args[:2]}: {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr}"
    )
    return proc


def _spec(tmp_path: Path, hold: str) -> Path:
    spec = tmp_path / "held.yaml"
    spec.write_text(f'name: held\ncommand: ["true"]\ndirectives: ["{hold}"]\n')
    return spec


def _check(lines: list[str], job_id: str, calls: list[str]) -> None:
    assert len(calls) <= 2, calls  # was 1,001: a query per task
    assert lines[0].split()[0] == job_id and len(lines) == 1 + TASKS, lines[:3]
    assert [ln.split()[1] for ln in lines[1:]] == ["PENDING"] * TASKS, lines[1:4]
    assert [ln.split()[2] for ln in lines[1:]] == [f"x={i}" for i in range(TASKS)]


@pytest.mark.slurm
def test_status_of_a_held_1000_task_sweep_is_one_squeue_on_real_slurm(slurm_cluster, tmp_path):
    runs = tmp_path / "runs"
    job_id = _hpc(
        "submit",
        str(_spec(tmp_path, "--hold")),
        "--cluster",
        "slurm",
        "--queue",
        "debug",
        "--runs-dir",
        str(runs),
        "--sweep",
        SWEEP,
    ).stdout.strip()
    try:
        (run_dir,) = runs.iterdir()
        path, log = _wrappers(
            tmp_path / "wrap", ["squeue", "scontrol", "sacct"], os.environ["PATH"]
        )
        lines = _hpc("status", str(run_dir), "--runs-dir", str(runs), path=path).stdout.splitlines()
        _check(lines, job_id, log.read_text().splitlines())
        assert lines[1].split()[0] == f"{job_id}_0"
    finally:
        slurm_cluster.run("scancel", job_id, check=False)


@pytest.mark.pbs
def test_status_of_a_held_1000_task_sweep_is_one_qstat_on_real_openpbs(openpbs, tmp_path):
    runs = tmp_path / "runs"
    job_id = _hpc(
        "submit",
        str(_spec(tmp_path, "-h")),
        "--cluster",
        "pbs",
        "--walltime",
        "00:05:00",
        "--runs-dir",
        str(runs),
        "--sweep",
        SWEEP,
    ).stdout.strip()
    try:
        assert job_id.split(".")[0].endswith("[]"), job_id
        (run_dir,) = runs.iterdir()
        path, log = _wrappers(tmp_path / "wrap", ["qstat"], os.environ["PATH"])
        lines = _hpc("status", str(run_dir), "--runs-dir", str(runs), path=path).stdout.splitlines()
        calls = log.read_text().splitlines()
        _check(lines, job_id, calls)
        assert calls[0].endswith(f"-t {job_id}"), calls  # the array's one id, not 1,000
    finally:
        openpbs.delete_all([job_id])
