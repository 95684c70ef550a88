"""Profiles are data: overrides merge per key, later directories win, extends works."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc import profiles as clusters
from hpc.errors import UserError
from tests.hpc.conftest import REPO


def test_builtin_profiles_load() -> None:
    names = clusters.names(environ={}, cwd=REPO)
    assert {"aurora", "polaris", "perlmutter", "frontier", "slurm", "pbs", "local"} <= set(names)
    aurora = clusters.load("aurora", environ={}, cwd=REPO)
    assert aurora.scheduler == "pbs" and aurora.ppn == 12
    assert aurora.env["CCL_KVS_MODE"] == "mpi" and aurora.account_required
    assert aurora.queues["debug-scaling"].min_nodes == 2
    assert clusters.load("frontier", environ={}, cwd=REPO).devices_per_node == 8


def test_user_project_and_env_dirs_merge_per_key(tmp_path: Path) -> None:
    home = tmp_path / "home"
    user = home / ".config" / "hpc-ddp" / "clusters"
    user.mkdir(parents=True)
    (user / "aurora.yaml").write_text("env: {USER_VAR: u}\nqueues: {debug: {walltime: '00:30:00'}}\n")
    project = tmp_path / "proj"
    (project / ".hpc" / "clusters").mkdir(parents=True)
    (project / ".hpc" / "clusters" / "aurora.yaml").write_text("env: {USER_VAR: p}\nmodules: [mine]\n")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "mysite.yaml").write_text("extends: slurm\nqueues: {short: {nodes: 1-4, walltime: '02:00:00'}}\n")
    env = {"HOME": str(home), "HPC_DDP_CLUSTERS": str(extra)}
    aurora = clusters.load("aurora", environ=env, cwd=project)
    assert aurora.env["USER_VAR"] == "p"  # project beats user
    assert aurora.env["CCL_KVS_MODE"] == "mpi"  # built-in keys kept
    assert aurora.modules == ("mine",)  # lists replace
    assert aurora.queues["debug"].max_walltime == 1800 and aurora.queues["debug"].max_nodes == 2
    assert len(aurora.sources) == 3
    site = clusters.load("mysite", environ=env, cwd=project)
    assert site.scheduler == "slurm" and site.queues["short"].max_nodes == 4
    assert "mysite" in clusters.names(environ=env, cwd=project)


def test_bad_profile_keys_are_named(tmp_path: Path) -> None:
    d = tmp_path / "c"
    d.mkdir()
    (d / "x.yaml").write_text("scheduler: slurm\nqueus: {}\n")
    with pytest.raises(UserError, match=r"unknown key 'queus' \(did you mean queues\?\)"):
        clusters.load("x", environ={"HPC_DDP_CLUSTERS": str(d)}, cwd=tmp_path)
    (d / "y.yaml").write_text("scheduler: lsf\n")
    with pytest.raises(UserError, match="scheduler: 'lsf'.*allowed: local, pbs, slurm"):
        clusters.load("y", environ={"HPC_DDP_CLUSTERS": str(d)}, cwd=tmp_path)
    (d / "z.yaml").write_text("extends: z\n")
    with pytest.raises(UserError, match="cycle"):
        clusters.load("z", environ={"HPC_DDP_CLUSTERS": str(d)}, cwd=tmp_path)
