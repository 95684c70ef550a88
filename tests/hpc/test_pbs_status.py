"""Both PBS readers against what a real OpenPBS server printed for every terminal state.

The JSON files in tests/hpc/data/openpbs/ are real ``qstat -x -f -F json`` answers (their
README says how each was made). ``hpc status`` reads through ``hpc.schedulers.pbs`` and
the submitit plugin through ``hpc.executors.pbs``: they must give the same answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc.schedulers import pbs as pbs_mod
from hpc.schedulers import pbs as sp

REAL = Path(__file__).parent / "data" / "openpbs"

# file -> (job id in it, the state both readers must report)
CASES = {
    "shared-finished.json": ("0.vm-pbs", "COMPLETED"),
    "failed-exit3.json": ("2.vm-pbs", "FAILED"),
    "deleted-queued.json": ("4.vm-pbs", "CANCELLED"),
    "shared-deleted.json": ("2.vm-pbs", "CANCELLED"),  # substate 91, Exit_status 271
    "deleted-running-exit0.json": ("3.vm-pbs", "CANCELLED"),  # substate 91, Exit_status 0
    "shared-walltime.json": ("5.vm-pbs", "TIMEOUT"),  # substate 93, Exit_status -29
    "shared-rerun.json": ("6.vm-pbs", "COMPLETED"),  # run_count 2 after qrerun
    "shared-array.json": ("3[].vm-pbs", "COMPLETED"),
}


def test_every_real_capture_is_covered() -> None:
    assert sorted(p.name for p in REAL.glob("*.json")) == sorted(CASES)


@pytest.mark.parametrize(("name", "job_id", "state"), [(n, *c) for n, c in CASES.items()])
def test_both_readers_agree_with_the_real_server(name: str, job_id: str, state: str) -> None:
    text = (REAL / name).read_text()
    assert pbs_mod.parse_qstat_json(text, job_id) == state
    assert pbs_mod.parse_qstat_json(text, job_id.split(".")[0]) == state
    assert sp.read_qstat_json(text)[job_id]["State"] == state


def test_text_form_reads_the_same() -> None:
    """``qstat -f`` (the fallback) of the same jobs: rebuilt from the JSON attributes."""
    for name, (job_id, state) in CASES.items():
        attrs = json.loads((REAL / name).read_text())["Jobs"][job_id]
        lines = [f"Job Id: {job_id}"] + [
            f"    {k} = {v}" for k, v in attrs.items() if not isinstance(v, dict)
        ]
        text = "\n".join(lines) + "\n"
        assert pbs_mod.parse_qstat_text(text) == state, name
        assert sp.read_qstat_text(text)[job_id]["State"] == state, name


def test_array_subjobs_of_the_real_server() -> None:
    info = sp.read_qstat_json((REAL / "shared-array.json").read_text())
    assert [info[f"3[].vm-pbs_{i}"]["State"] for i in range(3)] == ["COMPLETED"] * 3
    assert info["3[1].vm-pbs"]["array_index"] == "1"


@pytest.mark.parametrize(
    ("sub", "code", "state"),
    [
        ("91", 0, "CANCELLED"),
        ("91", 271, "CANCELLED"),
        ("91", 143, "CANCELLED"),
        ("91", None, "CANCELLED"),
        ("92", 0, "COMPLETED"),
        ("93", 3, "FAILED"),
        ("93", -29, "TIMEOUT"),
        ("93", 271, "FAILED"),
        (None, 271, "CANCELLED"),
        (None, -29, "TIMEOUT"),
        (None, 143, "FAILED"),
    ],
)
def test_substate_decides_before_exit_status(sub: str | None, code: int | None, state: str) -> None:
    assert pbs_mod.normalize("F", code, sub) == state
    # a job still exiting (E) or running with substate 91 is not finished yet
    assert pbs_mod.normalize("E", code, sub) == "RUNNING"
