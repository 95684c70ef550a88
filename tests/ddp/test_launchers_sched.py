"""The same DDP scripts under a real SLURM (srun) and under Aurora's PALS command line.

SLURM is real (tests/support/slurm.py starts it); PALS is the shim in
tests/support/pals/ (no PBS/PALS exists here), mapped onto real MPICH hydra.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ddp.launch_utils import (
    PY,
    SCRIPTS,
    assert_consistent,
    assert_torchrun_like,
    clean_env,
    records,
)
from tests.support.pals import pbs_env

TINY = str(SCRIPTS / "tiny_ddp.py")
PLAIN = str(SCRIPTS / "plain_torchrun_style.py")


def _batch(path: Path, body: str, *directives: str) -> Path:
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "set -eu",
        f"export PYTHONPATH={Path(__file__).resolve().parents[2] / 'src'}",
        "export OMP_NUM_THREADS=1",
        body,
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slurm
def test_srun_two_tasks(slurm_cluster, tmp_path):
    script = _batch(tmp_path / "job.sh", f"srun {PY} {TINY} {tmp_path}", "-n 2", "-N 1")
    job = slurm_cluster.submit(script)
    state = slurm_cluster.wait(job, timeout=120)
    assert state == "COMPLETED", slurm_cluster.output_path(job).read_text()
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert {r["launcher"] for r in recs} == {"slurm"}
    assert [r["local_rank"] for r in recs] == [0, 1]


@pytest.mark.slurm
@pytest.mark.multinode
def test_srun_across_two_nodes_with_exec(slurm_cluster, tmp_path):
    """A plain torchrun-style script, unmodified, over the two emulated nodes."""
    body = f"srun {PY} -m ddp.exec -- {PY} {PLAIN} {tmp_path}"
    job = slurm_cluster.submit(_batch(tmp_path / "job.sh", body, "-N 2", "--ntasks-per-node=1"))
    state = slurm_cluster.wait(job, timeout=120)
    assert state == "COMPLETED", slurm_cluster.output_path(job).read_text()
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert [r["local_rank"] for r in recs] == [0, 0]  # one task on each node
    assert_torchrun_like(recs, nodes=2)


@pytest.mark.slurm
def test_stale_rank_variables_before_srun_stop_the_job(slurm_cluster, tmp_path):
    """`RANK=0 LOCAL_RANK=0 WORLD_SIZE=1` left in the shell must not make `srun -n 2` two
    jobs of one rank each (each would train alone and write the same checkpoints)."""
    body = (
        f"export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1\nsrun --kill-on-bad-exit=1 {PY} {TINY} {tmp_path}"
    )
    job = slurm_cluster.submit(_batch(tmp_path / "job.sh", body, "-n 2", "-N 1"))
    assert slurm_cluster.wait(job, timeout=120) == "FAILED"
    log = slurm_cluster.output_path(job).read_text()
    assert "stale launcher variables: RANK=0 WORLD_SIZE=1" in log, log
    assert "rank 1 of 2" in log and "Traceback" not in log
    assert not list(tmp_path.glob("rank*.json")), "a rank trained anyway"


@pytest.mark.slurm
def test_batch_shell_without_srun_fails_fast_with_reason(slurm_cluster, tmp_path):
    job = slurm_cluster.submit(_batch(tmp_path / "job.sh", f"{PY} {TINY} {tmp_path}", "-n 2"))
    assert slurm_cluster.wait(job, timeout=120) == "FAILED"
    log = slurm_cluster.output_path(job).read_text()
    assert "SLURM_NTASKS=2" in log and "srun" in log
    assert "Traceback" not in log


@pytest.mark.mpi
def test_pals_command_line_with_pbs_environment(pals_mpiexec, tmp_path):
    """What jobs/dpo_aurora.pbs does on Aurora: PALS mpiexec with its binding flags."""
    env = clean_env(**pbs_env(tmp_path))
    env["PATH"] = f"{pals_mpiexec}{os.pathsep}{env['PATH']}"
    cmd = [
        "mpiexec",
        "-n",
        "2",
        "--ppn",
        "2",
        "--cpu-bind",
        "list:1:2",
        "--depth",
        "1",
        "--envall",
        PY,
        TINY,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert {r["launcher"] for r in recs} == {"pals"}
    assert [r["local_rank"] for r in recs] == [0, 1]


@pytest.mark.mpi
def test_exec_under_pals(pals_mpiexec, tmp_path):
    env = clean_env(**pbs_env(tmp_path))
    env["PATH"] = f"{pals_mpiexec}{os.pathsep}{env['PATH']}"
    cmd = [
        "mpiexec",
        "-n",
        "2",
        "--ppn",
        "2",
        "--envall",
        sys.executable,
        "-m",
        "ddp.exec",
        "--",
        PY,
        PLAIN,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert_torchrun_like(recs, nodes=1)
