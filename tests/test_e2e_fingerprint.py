"""The environment fingerprint on the real SLURM cluster: a 2-node job writes
``env-JOBID.json`` naming both nodes; a resubmission after one package changed shows
exactly that change in ``hpc report``, and no secret-like variable is ever written.

The package is a distribution as importlib.metadata (and ``pip freeze``) sees one: a
``NAME-VERSION.dist-info`` folder with its METADATA on the job's PYTHONPATH.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.test_e2e_schedulers import PY, ROOT, WORKER, hpc, submit, wait_status, worker_spec
from tests.test_e2e_schedulers import write_spec as _write_spec

pytestmark = pytest.mark.slurm


def _package(site: Path, version: str) -> None:
    for old in site.glob("fp_probe_pkg-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"fp_probe_pkg-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: fp-probe-pkg\nVersion: {version}\n"
    )


def test_two_nodes_fingerprint_and_a_changed_package_between_submissions(
    slurm_cluster: Any, tmp_path: Path
) -> None:
    runs, site = tmp_path / "runs", tmp_path / "site"
    _package(site, "0.1")
    spec = worker_spec(tmp_path)
    spec["config"]["checkpoint"]["dir"] = "ck"
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}:{site}",
        "NCCL_DEBUG": "WARN",
        "NCCL_IB_TOKEN": "do-not-record",
    }
    path = _write_spec(
        tmp_path / "fp.yaml", [PY, WORKER, json.dumps(spec)], nodes=2, ppn=1, env=env
    )
    job1, run_dir = submit(str(path), runs=runs)
    assert wait_status(job1, runs) == "COMPLETED"
    first = json.loads((run_dir / f"env-{job1}.json").read_text())
    assert sorted(first["nodes"]) == ["n1", "n2"] and first["nodes_differ"] == []
    assert first["software"]["packages"]["fp-probe-pkg"] == "0.1"
    assert first["env"]["NCCL_DEBUG"] == "WARN" and first["env"]["SLURM_JOB_ID"] == job1
    assert "do-not-record" not in (run_dir / f"env-{job1}.json").read_text()

    _package(site, "0.2")
    job2 = hpc(
        "submit", "--runs-dir", str(runs), "--resume", str(run_dir), str(path)
    ).stdout.strip()
    assert wait_status(job2, runs) == "COMPLETED"
    assert (run_dir / f"env-{job2}.json").is_file()
    out = hpc("report", str(run_dir)).stdout
    assert f"environment: job {job1} -> job {job2}: 1 change(s)" in out, out
    assert "package fp-probe-pkg: 0.1 -> 0.2" in out, out
