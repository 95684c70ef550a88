"""The job's venv staged to node-local storage (``python: {venv: P, stage: always}``) on
the real SLURM cluster (2 nodes: sbcast + one unpack task per node) and the real
OpenPBS server (one ``mpiexec`` rank per node).

What proves the ranks run from the copy: each rank prints ``sys.prefix`` and the path
of the venv's own entry point it ran (its ``#!`` line rewritten to the copy), and the
job's ``setup`` line renames the shared venv away after staging and before the launch,
so any rank that still read the shared venv would fail.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.openpbs import job_venv
from tests.support.parts import require_exe
from tests.test_e2e_schedulers import hpc as slurm_hpc
from tests.test_e2e_schedulers import log_of as slurm_log
from tests.test_e2e_schedulers import wait_status

#: The venv's own console script, as pip writes one: ``#!VENV/bin/python``.
PROBE = """#!{python}
import os, sys
rank = os.environ.get("SLURM_PROCID", os.environ.get("PMI_RANK", "?"))
print(f"rank={{rank}} prefix={{sys.prefix}} script={{os.path.realpath(sys.argv[0])}}", flush=True)
"""


def _staged_venv(where: Path) -> Path:
    venv = job_venv(where)
    probe = venv / "bin" / "stage-probe"
    probe.write_text(PROBE.format(python=venv / "bin" / "python"))
    probe.chmod(0o755)
    return venv


@pytest.fixture
def local_copies() -> Iterator[None]:
    """The copies the test jobs unpack in /tmp (both emulated nodes share this host's)."""
    before = set(Path("/tmp").glob("hpc-ddp-env-*"))
    yield
    for path in set(Path("/tmp").glob("hpc-ddp-env-*")) - before:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()


def _spec(path: Path, venv: Path, cluster: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "name": "staged",
                "cluster": cluster,
                "nodes": 2,
                "ppn": 1,
                "walltime": "00:05:00",
                "wrap": "never",
                "python": {"venv": str(venv), "stage": "always"},
                # after staging, before the launch: nothing may read the shared venv any more
                "setup": [shlex.join(["mv", str(venv), f"{venv}.moved"])],
                "command": ["stage-probe"],
                **({"queue": "debug"} if cluster == "slurm" else {}),
            }
        )
    )
    return path


def _check_ranks(log: str, job_id: str, ranks: tuple[str, ...]) -> None:
    dest = f"/tmp/hpc-ddp-env-{job_id}"
    for rank in ranks:
        line = f"rank={rank} prefix={dest} script={dest}/bin/stage-probe"
        assert line in log, log
    assert "shared venv" not in "".join(
        line for line in log.splitlines() if line.startswith("rank=")
    )


@pytest.mark.slurm
def test_slurm_ranks_run_from_the_node_local_copy(
    slurm_cluster: Any, tmp_path: Path, local_copies: None
) -> None:
    venv = _staged_venv(tmp_path / "shared venv")
    runs = tmp_path / "runs"
    proc = slurm_hpc(
        "submit", "--runs-dir", str(runs), str(_spec(tmp_path / "s.yaml", venv, "slurm"))
    )
    job_id = proc.stdout.strip()
    assert "python.stage: packed" in proc.stderr, proc.stderr
    (run_dir,) = runs.iterdir()
    assert (run_dir / "python-env.tar").is_file()
    assert wait_status(job_id, runs) == "COMPLETED", slurm_log(run_dir)
    log = slurm_log(run_dir)
    _check_ranks(log, job_id, ("0", "1"))
    assert log.count(f"python.stage: {os.uname().nodename}: /tmp/hpc-ddp-env-{job_id}") == 2, log
    assert not venv.exists() and (tmp_path / "shared venv.moved").is_dir()


@pytest.mark.pbs
def test_pbs_ranks_run_from_the_node_local_copy(
    openpbs: Any, tmp_path: Path, local_copies: None
) -> None:
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    from tests.test_e2e_pbs import Hpc
    from tests.test_e2e_pbs import log_of as pbs_log

    venv = _staged_venv(tmp_path / "shared venv")
    # hpc itself runs from another venv: the job renames the staged one away
    client = Hpc(job_venv(tmp_path / "client"), tmp_path / "runs")
    try:
        proc = client(
            "submit", "--runs-dir", str(client.runs), str(_spec(tmp_path / "p.yaml", venv, "pbs"))
        )
        job_id = proc.stdout.strip()
        client.submitted.append(job_id)
        assert "python.stage: packed" in proc.stderr, proc.stderr
        (run_dir,) = client.runs.iterdir()
        state = client.wait(run_dir)
    finally:
        openpbs.delete_all(client.submitted)
    log = pbs_log(run_dir)
    assert state == "COMPLETED", log
    _check_ranks(log, job_id, ("0", "1"))
    assert f"python.stage: {os.uname().nodename}: /tmp/hpc-ddp-env-{job_id}" in log, log
