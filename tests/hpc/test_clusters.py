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
    (user / "aurora.yaml").write_text(
        "env: {USER_VAR: u}\nqueues: {debug: {walltime: '00:30:00'}}\n"
    )
    project = tmp_path / "proj"
    (project / ".hpc" / "clusters").mkdir(parents=True)
    (project / ".hpc" / "clusters" / "aurora.yaml").write_text(
        "env: {USER_VAR: p}\nmodules: [mine]\n"
    )
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "mysite.yaml").write_text(
        "extends: slurm\nqueues: {short: {nodes: 1-4, walltime: '02:00:00'}}\n"
    )
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


# --- values that reach a #SBATCH/#PBS line (issue 24) -----------------------------------

BREAKS = ["\n", "\r", "\x0b", "\x0c", "\x85", "\u2028", "\x00", "\x1b"]


def _profile(tmp_path: Path, text: str, name: str = "site") -> Path:
    d = tmp_path / "profiles"
    d.mkdir(exist_ok=True)
    (d / f"{name}.yaml").write_text(text, encoding="utf-8")
    return d


@pytest.mark.parametrize("brk", BREAKS[:2])
def test_a_queue_name_with_a_line_break_is_refused_at_load(tmp_path: Path, brk: str) -> None:
    """A queue name reaches ``#SBATCH --partition=NAME``: a line break there was a new
    directive line (``#SBATCH --exclusive`` added by a profile's queue name)."""
    import json

    queue = json.dumps(f"debug{brk}#SBATCH --exclusive")
    d = _profile(tmp_path, f"extends: slurm\nqueues: {{{queue}: {{nodes: 1-2}}}}\n")
    with pytest.raises(UserError, match=r"cluster site: queues: .*scheduler directive"):
        clusters.load("site", environ={"HPC_DDP_CLUSTERS": str(d)}, cwd=tmp_path)


@pytest.mark.parametrize(
    "key", ["directives", "queues.debug.directives", "queues.debug.notes", "modules", "module_use"]
)
@pytest.mark.parametrize("brk", BREAKS)
def test_profile_lines_hold_one_line_of_text(tmp_path: Path, key: str, brk: str) -> None:
    import json

    value = json.dumps([f"-l x{brk}#PBS -l y"])
    body = (
        f"queues: {{debug: {{{key.rsplit('.', 1)[1]}: {value}}}}}"
        if key.startswith("queues")
        else f"{key}: {value}"
    )
    d = _profile(tmp_path, f"extends: pbs\n{body}\n")
    with pytest.raises(UserError, match=r"one line of printable text"):
        clusters.load("site", environ={"HPC_DDP_CLUSTERS": str(d)}, cwd=tmp_path)


@pytest.mark.parametrize("name", ["1X", "A-B", "A B", "A\nB", ""])
def test_account_env_names_are_variable_names(tmp_path: Path, name: str) -> None:
    import json

    d = _profile(tmp_path, f"extends: pbs\naccount_env: [{json.dumps(name)}]\n")
    with pytest.raises(UserError, match=r"account_env: .* is not a variable name"):
        clusters.load("site", environ={"HPC_DDP_CLUSTERS": str(d)}, cwd=tmp_path)


def test_plain_profile_values_still_load(tmp_path: Path) -> None:
    d = _profile(
        tmp_path,
        "extends: slurm\naccount_env: [MY_ACCT]\nmodules: [cuda/12.4, 'gcc@13']\n"
        "directives: ['--exclusive', '--mail-type=END\tx']\n"
        "queues: {'gpu_a100': {nodes: 1-4, notes: ['a note: ok']}}\n",
    )
    site = clusters.load("site", environ={"HPC_DDP_CLUSTERS": str(d)}, cwd=tmp_path)
    assert site.queues["gpu_a100"].notes == ("a note: ok",) and site.account_env == ("MY_ACCT",)


# --- profiles and specs are files the user may not have written (issue 24) ---------------


def test_a_named_pipe_as_profile_or_spec_is_refused_at_once(tmp_path: Path) -> None:
    """``./.hpc/clusters/NAME.yaml`` comes with a cloned project; a pipe there (or as the
    spec) blocked ``hpc render`` forever in ``open``; a pipe profile was skipped silently."""
    import os

    d = tmp_path / "profiles"
    d.mkdir()
    os.mkfifo(d / "site.yaml")
    with pytest.raises(UserError, match=r"site\.yaml' is a named pipe"):
        clusters.load("site", environ={"HPC_DDP_CLUSTERS": str(d)}, cwd=tmp_path)
    from hpc.spec import load_spec

    os.mkfifo(tmp_path / "job.yaml")
    with pytest.raises(UserError, match=r"spec: .*job\.yaml' is a named pipe"):
        load_spec(tmp_path / "job.yaml")


def test_a_huge_spec_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from hpc import _util
    from hpc.spec import load_spec

    spec = tmp_path / "big.yaml"
    with spec.open("wb") as fh:
        fh.truncate(_util.MAX_YAML_BYTES + 1)  # sparse: no disk used
    with pytest.raises(UserError, match=r"big\.yaml' is .* bytes; allowed: at most"):
        load_spec(spec)


def test_a_profile_from_the_working_directory_is_announced_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its ``setup`` lines run in every job: a render should not change silently with the
    folder it runs in (as for ./templates)."""
    import logging

    (tmp_path / ".hpc" / "clusters").mkdir(parents=True)
    own = tmp_path / ".hpc" / "clusters" / "slurm.yaml"
    own.write_text("setup: ['echo from the project']\n")
    monkeypatch.setattr(clusters, "_ANNOUNCED", set())
    with caplog.at_level(logging.INFO, logger="hpc.profiles"):
        for _ in range(2):
            assert clusters.load("slurm", environ={}, cwd=tmp_path).setup == (
                "echo from the project",
            )
        clusters.load("pbs", environ={}, cwd=tmp_path)
    notes = [r.getMessage() for r in caplog.records if r.name == "hpc.profiles"]
    assert len(notes) == 1 and str(own) in notes[0] and "working directory" in notes[0], notes
