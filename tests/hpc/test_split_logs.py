"""``split_logs``: the rendered directives, the run record and ``hpc logs --err``'s file.

The real schedulers writing the two files: tests/test_e2e_split_logs.py.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from hpc import logs, runs
from hpc.errors import UserError
from hpc.render import render
from hpc.spec import JobSpec
from tests.hpc.conftest import REPO, make_job


def _script(cluster: str, **kw: object) -> str:
    return render(make_job(cluster, nodes="2", command=["python", "t.py"], **kw), cwd=REPO)


@pytest.mark.parametrize("split", [False, True])
def test_slurm_error_directive_only_when_split(split: bool) -> None:
    text = _script("slurm", split_logs=split)
    assert "#SBATCH --output=logs/%x-%j.out" in text
    assert ("#SBATCH --error=logs/%x-%j.err" in text) is split
    job = make_job("slurm", split_logs=split, command=["python", "t.py"])
    sweep = render(replace(job, array_size=2), cwd=REPO)
    assert ("#SBATCH --error=logs/%x-%A_%a.err" in sweep) is split


@pytest.mark.parametrize("cluster", ["aurora", "polaris", "pbs"])
def test_pbs_joins_only_when_not_split(cluster: str) -> None:
    merged, split = _script(cluster, account="p"), _script(cluster, account="p", split_logs=True)
    assert "#PBS -j oe" in merged and "#PBS -e " not in merged
    assert "#PBS -j oe" not in split and "#PBS -e logs/" in split and "#PBS -o logs/" in split
    for text in (merged, split):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_spec_key_is_a_boolean_and_reaches_the_resolved_spec() -> None:
    assert JobSpec.from_mapping({"command": ["x"], "split_logs": True}).split_logs is True
    with pytest.raises(UserError, match="split_logs") as info:
        JobSpec.from_mapping({"command": ["x"], "split_logs": "yes please"})
    assert "\n" not in str(info.value)
    job = make_job("slurm", split_logs=True, command=["x"])
    assert job.to_dict()["split_logs"] is True
    assert "split_logs" not in make_job("slurm", command=["x"]).to_dict()


def _record(run_dir: Path, scheduler: str, job_id: str, split: bool) -> None:
    record = {"name": "t", "scheduler": scheduler, "job_id": job_id, "script": "job"}
    if split:
        record["split_logs"] = True
    runs.write_record(run_dir, record)


@pytest.mark.parametrize(
    ("scheduler", "job_id", "out", "err"),
    [
        ("slurm", "101", "t-101.out", "t-101.err"),
        ("pbs", "7.server", "7.server.OU", "7.server.ER"),
    ],
)
def test_err_log_beside_the_out_log(
    tmp_path: Path, scheduler: str, job_id: str, out: str, err: str
) -> None:
    _record(tmp_path, scheduler, job_id, split=True)
    found = logs.find_log(tmp_path)
    assert found == tmp_path / out  # not started yet: the names it will write
    assert logs.err_log(tmp_path, found) == tmp_path / err
    # a merged job: one line saying where stderr went
    _record(tmp_path, scheduler, job_id, split=False)
    with pytest.raises(UserError, match="stdout and stderr together") as info:
        logs.err_log(tmp_path, logs.find_log(tmp_path))
    assert "\n" not in str(info.value)
    # ...unless its stderr file is there (a script run with plain sbatch -e)
    (tmp_path / err).write_text("boom\n")
    assert logs.err_log(tmp_path, logs.find_log(tmp_path)) == tmp_path / err


def test_pbs_default_names_without_o(tmp_path: Path) -> None:
    from hpc import schedulers

    pbs = schedulers.get("pbs")
    assert pbs.err_log_name("train.o123") == "train.e123"
    assert pbs.err_log_name("123[4].server.OU") == "123[4].server.ER"
    assert pbs.err_log_name("weird.log") is None
    assert schedulers.get("local").err_log_name("output.log") is None
