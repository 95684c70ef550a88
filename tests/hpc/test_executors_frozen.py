"""The Python API's PBS executor holds one resolved, frozen Job and uses PBS's own clients.

Before: ``hpc.executor`` took the resolved job apart into parameters and
``PBSExecutor.resolve()`` rebuilt it (reading the profile YAML again) five times per
executor and submit; ``map_array`` flipped a mutable ``_array_size`` flag; submit and
cancel were written a second time, and ``PBSJob.cancel`` raised ``CalledProcessError``
where ``hpc cancel`` says ``SchedulerError``. Fake ``qsub``/``qdel`` stand for the
server here (what they print is what the real OpenPBS 23.06 clients print); the whole
jobs run on the real server in test_submitit_pbs.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import hpc
from hpc import core, profiles
from hpc.errors import SchedulerError
from hpc.executors import pbs as sp


@pytest.fixture(autouse=True)
def _no_account(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PBS_ACCOUNT", "HPC_ACCOUNT"):
        monkeypatch.delenv(var, raising=False)


def add(a: int, b: int) -> int:
    return a + b


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every profile YAML file read from now on (the loader patched where profiles calls it)."""
    reads: list[str] = []
    real = profiles.load_yaml

    def counting(path: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(profiles, "load_yaml", counting)
    return reads


def test_the_profile_is_read_once_per_executor_and_submit(
    fake_bin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_bin("qsub", 'echo "77.vm-pbs"')
    reads = _count_reads(monkeypatch)
    core.build_job(None, {"cluster": "pbs", "command": ["python", "x.py"]})
    one = list(reads)  # what one resolution (hpc render) reads
    assert one, "the counter sees the profile loader"
    reads.clear()
    ex = hpc.executor(cluster="pbs", folder=tmp_path / "jobs")
    job = ex.submit(add, 1, 2)
    assert job.job_id == "77.vm-pbs"
    assert reads == one  # once, not once per resolve() (five before)
    reads.clear()
    ex.update_parameters(nodes=2)  # a change resolves again, once
    assert reads == one and ex.resolve().nodes == 2


def test_the_executor_keeps_a_frozen_job_and_an_array_is_a_replace(
    fake_bin: Any, tmp_path: Path
) -> None:
    fake_bin("qsub", 'echo "78[].vm-pbs"')
    ex = hpc.executor(cluster="pbs", folder=tmp_path / "jobs", walltime="00:10:00")
    assert isinstance(ex, sp.PBSExecutor)
    held = ex.resolve()
    assert ex.resolve() is held  # the same object, never rebuilt
    with pytest.raises(dataclasses.FrozenInstanceError):
        held.nodes = 3  # type: ignore[misc]
    jobs = ex.map_array(add, [1, 2, 3], [10, 20, 30])
    assert [j.job_id for j in jobs] == [f"78[].vm-pbs_{i}" for i in range(3)]
    assert "#PBS -J 0-2\n" in jobs[0].paths.submission_file.read_text()
    assert ex.resolve() is held and not any("-J" in d for d in held.spec.directives)
    single = ex.submit(add, 1, 1)  # the next job is no array
    assert "#PBS -J" not in single.paths.submission_file.read_text()


def test_pbs_job_cancel_refused_is_a_scheduler_error(fake_bin: Any, tmp_path: Path) -> None:
    # The real qdel of an id the server does not know (OpenPBS 23.06): stderr, exit 153.
    fake_bin("qdel", 'echo "qdel: Unknown Job Id $1" >&2; exit 153')
    job: Any = sp.PBSJob(folder=tmp_path, job_id="999999.vm-pbs")
    with pytest.raises(SchedulerError) as exc:
        job.cancel()
    assert str(exc.value) == (
        "qdel 999999.vm-pbs failed (exit 153): qdel: Unknown Job Id 999999.vm-pbs"
    )
    job.cancel(check=False)  # submitit's unchecked cancel (at deletion): no error
    assert fake_bin.log.read_text().splitlines() == ["qdel 999999.vm-pbs"] * 2


def test_qsub_refusal_and_run_record(
    fake_bin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qsub's refusal is PBS.submit's line; the run record is the CLI's (hpc.runs.new_record)
    with the submitit executor's ids in the form qstat takes (a subjob 78[1].vm-pbs)."""
    monkeypatch.chdir(tmp_path)
    fake_bin("qsub", 'echo "qsub: Unknown queue" >&2; exit 170')
    ex = hpc.executor(cluster="pbs", name="rec")
    with pytest.raises(
        SchedulerError, match=r"^qsub refused the job \(exit 170\): qsub: Unknown queue$"
    ):
        ex.submit(add, 1, 2)
    fake_bin("qsub", 'echo "78[].vm-pbs"')
    ex.map_array(add, [1, 2], [3, 4])
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["job_ids"] == ["78[0].vm-pbs", "78[1].vm-pbs"]
    assert record["job_id"] == "78[1].vm-pbs"
    assert (record["scheduler"], record["cluster"], record["executor"]) == (
        "pbs",
        "pbs",
        "submitit PBSExecutor",
    )
    for key in ("cwd", "created", "git_commit", "spec", "name", "folder"):
        assert key in record
