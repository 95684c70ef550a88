"""``split_logs: true`` on the real schedulers: stdout and stderr in two files, as seed 001's
scripts had them (``tail -f logs/dpo_ddp_*.out`` / ``*.err``), and ``hpc logs --err``.

SLURM writes ``NAME-ID.out`` and ``NAME-ID.err`` (``--output``/``--error``); OpenPBS, given
a folder for ``-o`` and ``-e`` and no ``-j oe``, writes ``ID.OU`` and ``ID.ER`` there.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.openpbs import OpenPBS
from tests.test_e2e_pbs import Hpc
from tests.test_e2e_schedulers import hpc, submit, wait_status

PRINT = "import sys; print('OUT-LINE', flush=True); print('ERR-LINE', file=sys.stderr, flush=True)"


def _spec(path: Path, cluster: str, split: bool) -> Path:
    data: dict[str, Any] = {
        "name": "split",
        "cluster": cluster,
        "nodes": 1,
        "ppn": 1,
        "walltime": "00:05:00",
        "wrap": "never",
        "split_logs": split,
        "command": [sys.executable, "-c", PRINT],
    }
    if cluster == "slurm":
        data["queue"] = "debug"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slurm
def test_slurm_job_writes_out_and_err_apart(slurm_cluster: Any, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    job_id, run_dir = submit(str(_spec(tmp_path / "s.yaml", "slurm", True)), runs=runs)
    assert "#SBATCH --error=" in (run_dir / "job.slurm").read_text()
    assert wait_status(job_id, runs) == "COMPLETED"
    out = (run_dir / f"split-{job_id}.out").read_text()
    err = (run_dir / f"split-{job_id}.err").read_text()
    assert "OUT-LINE" in out and "ERR-LINE" not in out
    assert "ERR-LINE" in err and "OUT-LINE" not in err
    shown = hpc("logs", job_id, "--runs-dir", str(runs)).stdout
    assert "OUT-LINE" in shown and "ERR-LINE" not in shown
    shown = hpc("logs", job_id, "--err", "--runs-dir", str(runs)).stdout
    assert "ERR-LINE" in shown and "OUT-LINE" not in shown

    # merged (the default): one log, and --err says where stderr is, exit 2
    job_id, run_dir = submit(str(_spec(tmp_path / "m.yaml", "slurm", False)), runs=runs)
    assert wait_status(job_id, runs) == "COMPLETED"
    both = (run_dir / f"split-{job_id}.out").read_text()
    assert "OUT-LINE" in both and "ERR-LINE" in both
    assert not list(run_dir.glob("*.err"))
    proc = hpc("logs", job_id, "--err", "--runs-dir", str(runs), check=False)
    assert proc.returncode == 2 and "stdout and stderr together" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.pbs
def test_pbs_job_writes_ou_and_er_apart(
    openpbs: OpenPBS, pbs_job_venv: Path, tmp_path: Path
) -> None:
    client = Hpc(pbs_job_venv, tmp_path / "runs")
    try:
        job_id, run_dir = client.submit(str(_spec(tmp_path / "p.yaml", "pbs", True)))
        script = next(run_dir.glob("job*.pbs")).read_text()
        assert "#PBS -e " in script and "#PBS -j oe" not in script
        assert client.wait(run_dir) == "COMPLETED"
        (ou,) = run_dir.glob("*.OU")
        (er,) = run_dir.glob("*.ER")
        assert ou.name[: -len(".OU")] == er.name[: -len(".ER")] == job_id
        assert "OUT-LINE" in ou.read_text() and "ERR-LINE" not in ou.read_text()
        assert "ERR-LINE" in er.read_text() and "OUT-LINE" not in er.read_text()
        shown = client("logs", str(run_dir), "--err", "--runs-dir", str(client.runs)).stdout
        assert "ERR-LINE" in shown and "OUT-LINE" not in shown
    finally:
        openpbs.delete_all(client.submitted)
