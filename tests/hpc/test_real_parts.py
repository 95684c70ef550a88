"""Rendered scripts against real parts: a real SLURM (sbatch --test-only, a submitted job
followed to the end with hpc status) and the PALS mpiexec shim running an Aurora script.
Fixtures come from tests/support/fixtures.py and skip (fail under CI) when a part is missing."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.cli import main
from hpc.render import render
from tests.hpc.conftest import REPO, make_job

try:  # the fixture module may be absent in a trimmed checkout
    import tests.support.fixtures  # noqa: F401

    HAVE_FIXTURES = True
except ImportError:  # pragma: no cover
    HAVE_FIXTURES = False


def _cluster(request: pytest.FixtureRequest) -> object:
    from tests.support.parts import require

    require(HAVE_FIXTURES, "tests/support/fixtures.py (slurm_cluster fixture) is not importable")
    return request.getfixturevalue("slurm_cluster")


@pytest.mark.slurm
def test_sbatch_test_only_accepts_checked_in_script(request: pytest.FixtureRequest) -> None:
    cluster = _cluster(request)
    proc = cluster.run(
        "sbatch",
        "--test-only",
        str(REPO / "jobs" / "uniref50.slurm"),  # type: ignore[attr-defined]
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "to start at" in proc.stderr


@pytest.mark.slurm
def test_submit_and_follow_a_job(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _cluster(request)
    monkeypatch.chdir(tmp_path)
    argv = [
        "submit",
        "--cluster",
        "slurm",
        "--ppn",
        "2",
        "--name",
        "hpc probe",
        "--wrap",
        "never",
        "--walltime",
        "00:05:00",
        "--runs-dir",
        "runs",
        "--",
        "bash",
        "-c",
        'echo "rank=$SLURM_PROCID arg=$1"',
        "_",
        "a b;$(x)",
    ]
    assert main(argv) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.isdigit()
    deadline = time.monotonic() + 90
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        assert main(["status", job_id, "--runs-dir", "runs"]) == 0
        state = capsys.readouterr().out.split()[-1]
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            break
        time.sleep(0.2)
    assert state == "COMPLETED"
    # the log is kept in the run directory (runs/.index: the job-id index status made)
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")]
    log = (run_dir / f"hpc_probe-{job_id}.out").read_text()
    # each line under srun --label's rank prefix (per-rank files off: issue 31)
    assert sorted(log.split("\n")[:2]) == ["0: rank=0 arg=a b;$(x)", "1: rank=1 arg=a b;$(x)"]


@pytest.mark.mpi
def test_aurora_script_runs_under_pals_shim(pals_mpiexec: Path, tmp_path: Path) -> None:
    """The Aurora launch line, flags and all, starts the ranks; ddp.exec gives a plain
    script torchrun's variables."""
    from tests.support.pals import pbs_env

    code = (
        "import os; e = os.environ; "  # one write per rank: lines never interleave
        "os.write(1, f\"R {e['RANK']} {e['LOCAL_RANK']} {e['WORLD_SIZE']}\\n\".encode())"
    )
    job = make_job(
        "aurora",
        account="p",
        nodes="1",
        ppn="2",
        command=[sys.executable, "-c", code],
        env={"DDP_MASTER_ADDR_SUFFIX": ""},
    )
    assert job.wrapped
    script = tmp_path / "job.pbs"
    script.write_text(render(job))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "module").write_text("#!/bin/sh\nexit 0\n")  # Aurora's `module load frameworks`
    (fake / "module").chmod(stat.S_IRWXU)
    env = dict(os.environ, **pbs_env(tmp_path, workdir=tmp_path))
    env["PATH"] = os.pathsep.join([str(pals_mpiexec), str(fake), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        ["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # PALS --label: each line under its rank's "N: " (per-rank files off: issue 31)
    ranks = sorted(ln for ln in proc.stdout.splitlines() if ": R " in ln)
    assert ranks == ["0: R 0 0 2", "1: R 1 1 2"], proc.stdout + proc.stderr
