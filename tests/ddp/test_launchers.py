"""Real multi-process runs of one small DDP script under every launcher available here.

Each asserts that every rank ends with identical weights and that reduce_mean is right.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.ddp.launch_utils import (
    PY,
    ROOT,
    SCRIPTS,
    assert_consistent,
    assert_torchrun_like,
    clean_env,
    records,
    run,
)
from tests.support.parts import require_exe
from tests.support.ports import free_port

TINY = str(SCRIPTS / "tiny_ddp.py")
PLAIN = str(SCRIPTS / "plain_torchrun_style.py")
OMPI_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def test_plain_python_is_world_one(tmp_path):
    run([PY, TINY, str(tmp_path)], clean_env())
    (rec,) = records(tmp_path, 1)
    assert rec["launcher"] == "single" and rec["world_size"] == 1
    assert rec["backend"] == "gloo" and rec["device"] == "cpu"
    assert rec["reduce_mean"] == 1.0


def test_torchrun_two_processes(tmp_path):
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        TINY,
        str(tmp_path),
    ]
    run(cmd, clean_env())
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert {r["launcher"] for r in recs} == {"torchrun"}
    assert [r["local_rank"] for r in recs] == [0, 1]


def test_legacy_launch_local_rank_argument(tmp_path):
    # torch.distributed.launch without --use-env passes --local-rank=N on the command line.
    cmd = [
        PY,
        "-m",
        "torch.distributed.launch",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        TINY,
        str(tmp_path),
    ]
    env = clean_env(PYTHONWARNINGS="ignore")
    run(cmd, env)
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert [r["local_rank"] for r in recs] == [0, 1]


def test_legacy_local_rank_flag_only(tmp_path):
    # What the old launcher gave before LOCAL_RANK existed: RANK/WORLD_SIZE in env, the
    # local rank only as a flag. Started by hand so no LOCAL_RANK can leak in.
    import subprocess

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [PY, TINY, f"--local_rank={r}", str(tmp_path)],
            env=clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        )
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert {r["launcher"] for r in recs} == {"legacy"}
    assert [r["local_rank"] for r in recs] == [0, 1]


@pytest.mark.mpi
def test_mpich_without_master_addr_or_port(tmp_path):
    mpiexec = require_exe("mpiexec.hydra", "mpiexec.mpich")
    run([mpiexec, "-n", "2", PY, TINY, str(tmp_path)], clean_env())
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert {r["launcher"] for r in recs} == {"mpich"}
    assert [r["local_rank"] for r in recs] == [0, 1]


@pytest.mark.mpi
def test_openmpi(tmp_path):
    mpiexec = require_exe("mpiexec.openmpi")
    cmd = [mpiexec, "--oversubscribe", "-n", "2", PY, TINY, str(tmp_path)]
    run(cmd, clean_env(**OMPI_ROOT))
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert {r["launcher"] for r in recs} == {"openmpi"}


@pytest.mark.mpi
def test_exec_runs_plain_script_under_mpich(tmp_path):
    mpiexec = require_exe("mpiexec.hydra", "mpiexec.mpich")
    run([mpiexec, "-n", "2", PY, "-m", "ddp.exec", "--", PY, PLAIN, str(tmp_path)], clean_env())
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert [r["local_rank"] for r in recs] == [0, 1]
    assert_torchrun_like(recs, nodes=1)


@pytest.mark.mpi
def test_exec_runs_plain_script_under_openmpi(tmp_path):
    mpiexec = require_exe("mpiexec.openmpi")
    cmd = [
        mpiexec,
        "--oversubscribe",
        "-n",
        "2",
        PY,
        "-m",
        "ddp.exec",
        "--",
        PY,
        PLAIN,
        str(tmp_path),
    ]
    run(cmd, clean_env(**OMPI_ROOT))
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert_torchrun_like(recs, nodes=1)


@pytest.mark.mpi
def test_recipe_cli_under_mpich(tmp_path):
    """`python -m ddp RECIPE` unchanged under plain MPICH mpiexec (no MASTER_* given)."""
    mpiexec = require_exe("mpiexec.hydra", "mpiexec.mpich")
    cmd = [
        mpiexec,
        "-n",
        "2",
        PY,
        "-m",
        "ddp",
        "uniref50",
        "--config",
        "configs/uniref50-tiny.yaml",
        "--set",
        "training.max_steps=4",
        f"checkpoint.dir={tmp_path}",
        "logging.progress=plain",
    ]
    proc = subprocess.run(
        cmd, env=clean_env(), capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Initialized DDP: rank=0, world_size=2, local_rank=0" in proc.stdout
    assert "done: steps=4" in proc.stdout
    assert (tmp_path / "final" / "model.pt").is_file()
