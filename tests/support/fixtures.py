"""pytest plugin with the real-part fixtures: SLURM cluster, OpenPBS, PALS shim, network namespaces.

Registered from tests/conftest.py (``pytest_plugins = ["tests.support.fixtures"]``) or
``-p tests.support.fixtures``. Every fixture goes through ``parts.require``: a missing
part skips on a laptop and fails under CI=true.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import netns, slurm
from tests.support.openpbs import lmod_frameworks, openpbs, openpbs_server, pbs_job_venv
from tests.support.pals import PALS_DIR, RANK_WRAPPER, SHIM
from tests.support.parts import require, require_exe

__all__ = [
    "lmod_frameworks",
    "netns_pair",
    "openpbs",
    "openpbs_server",
    "pals_mpiexec",
    "pbs_job_venv",
    "slurm_cluster",
]


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[slurm.SlurmCluster]:
    """One real SLURM (n1, n2) per session; SLURM_CONF is exported while it lives."""
    missing = slurm.missing_exes()
    require(not missing, f"SLURM (slurm-wlm, munge) not installed: missing {', '.join(missing)}")
    require(os.geteuid() == 0, "the SLURM fixture runs slurmd as root (SlurmdUser=root)")
    with slurm.start_cluster() as cluster, pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(cluster.conf))
        yield cluster


@pytest.fixture
def pals_mpiexec() -> Path:
    """Folder to put first on PATH so ``mpiexec`` takes Aurora/PALS flags (via MPICH hydra)."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    require(
        os.access(SHIM, os.X_OK) and os.access(RANK_WRAPPER, os.X_OK),
        f"PALS shim scripts in {PALS_DIR} are not executable (git lost mode 755?)",
    )
    return PALS_DIR


@pytest.fixture
def netns_pair() -> Iterator[netns.NetnsPair]:
    """Two network namespaces joined by veth, 10.200.0.1 <-> 10.200.0.2."""
    reason = netns.missing_reason()
    require(reason is None, reason or "")
    with netns.netns_pair_ctx() as pair:
        yield pair
