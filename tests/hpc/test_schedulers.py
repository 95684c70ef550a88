"""Scheduler clients: id parsing, state normalization, and the status fallbacks."""

from __future__ import annotations

import pytest

from hpc.schedulers import STATES, SchedulerError, get
from hpc.schedulers import pbs as pbs_mod
from hpc.schedulers import slurm as slurm_mod


def test_parse_job_ids() -> None:
    assert get("slurm").parse_job_id("4242\n") == "4242"
    assert get("slurm").parse_job_id("4242;cluster1\n") == "4242"
    assert get("slurm").parse_job_id("Submitted batch job 17\n") == "17"
    assert get("pbs").parse_job_id("123.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov\n") == (
        "123.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov")
    assert get("pbs").parse_job_id("55\n") == "55"
    for name in ("slurm", "pbs"):
        with pytest.raises(SchedulerError, match="no job id"):
            get(name).parse_job_id("error: nope\n")


@pytest.mark.parametrize(("raw", "state"), [
    ("PENDING", "PENDING"), ("CONFIGURING", "RUNNING"), ("COMPLETING", "RUNNING"),
    ("COMPLETED", "COMPLETED"), ("CANCELLED by 0", "CANCELLED"), ("CANCELLED+", "CANCELLED"),
    ("TIMEOUT", "TIMEOUT"), ("NODE_FAIL", "FAILED"), ("OUT_OF_MEMORY", "FAILED"),
    ("PREEMPTED", "PREEMPTED"), ("REQUEUED", "PENDING"), ("WEIRD", "UNKNOWN"), ("", "UNKNOWN"),
])
def test_slurm_normalize(raw: str, state: str) -> None:
    assert slurm_mod.normalize(raw) == state
    assert state in STATES


@pytest.mark.parametrize(("letter", "code", "state"), [
    ("Q", None, "PENDING"), ("H", None, "PENDING"), ("R", None, "RUNNING"), ("E", None, "RUNNING"),
    ("F", 0, "COMPLETED"), ("F", 1, "FAILED"), ("F", -29, "TIMEOUT"), ("F", 271, "CANCELLED"),
    ("Z", None, "UNKNOWN"),
])
def test_pbs_normalize(letter: str, code: int | None, state: str) -> None:
    assert pbs_mod.normalize(letter, code) == state


def test_pbs_qstat_parsers() -> None:
    text = '{"Jobs": {"9.srv": {"job_state": "F", "Exit_status": 2}}}'
    assert pbs_mod.parse_qstat_json(text, "9.srv") == "FAILED"
    assert pbs_mod.parse_qstat_json(text, "9") == "FAILED"
    assert pbs_mod.parse_qstat_json(text, "10") == "UNKNOWN"
    full = "Job Id: 9.srv\n    Job_Name = x\n    job_state = R\n    queue = debug\n"
    assert pbs_mod.parse_qstat_text(full) == "RUNNING"


def test_slurm_status_falls_back_past_disabled_accounting(fake_bin) -> None:
    fake_bin("squeue", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    fake_bin("sacct", """if [ "$1" = "-c" ]; then echo COMPLETED; else
echo 'Slurm accounting storage is disabled' >&2; exit 1; fi""")
    fake_bin("scontrol", "exit 1")
    assert get("slurm").status("12") == "COMPLETED"
    log = fake_bin.log.read_text()
    assert "sacct -X -n -P -j 12 -o State" in log and "sacct -c -n -P -j 12 -o State" in log


def test_slurm_status_asks_scontrol_before_sacct(fake_bin) -> None:
    fake_bin("squeue", "exit 0")
    fake_bin("sacct", "echo 'accounting storage is disabled'; exit 0")
    fake_bin("scontrol", "echo 'JobId=12 JobName=x'; echo '   JobState=TIMEOUT Reason=TimeLimit'")
    assert get("slurm").status("12") == "TIMEOUT"


def test_slurm_status_of_a_requeued_job_is_its_latest_run(fake_bin) -> None:
    """The jobcomp log holds one record a run: the first REQUEUED, the last the outcome."""
    fake_bin("squeue", "exit 0")
    fake_bin("scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    fake_bin("sacct", """if [ "$1" = "-c" ]; then printf 'REQUEUED\nCOMPLETED\n'; else
echo 'Slurm accounting storage is disabled' >&2; exit 1; fi""")
    assert get("slurm").status("12") == "COMPLETED"


def test_pbs_status_falls_back_to_plain_qstat(fake_bin) -> None:
    fake_bin("qstat", """if [ "$1" = "-x" ]; then echo 'qstat: invalid option -- x' >&2; exit 2; fi
printf 'Job Id: 3.s\\n    job_state = Q\\n'""")
    assert get("pbs").status("3.s") == "PENDING"


def test_missing_client_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SchedulerError, match="sbatch not found on PATH"):
        get("slurm").submit("x.slurm", str(tmp_path))


def test_cancel_reports_refusal(fake_bin) -> None:
    fake_bin("scancel", "echo 'scancel: error: Invalid job id 5' >&2; exit 1")
    with pytest.raises(SchedulerError, match="Invalid job id 5"):
        get("slurm").cancel("5")


def test_pbs_job_deleted_while_queued_has_no_exit_status() -> None:
    """Finished without Exit_status: the substate (91/92/93) tells how it ended."""
    text = '{"Jobs": {"7.srv": {"job_state": "F", "substate": 91}}}'
    assert pbs_mod.parse_qstat_json(text, "7.srv") == "CANCELLED"
    assert pbs_mod.parse_qstat_text("Job Id: 7\n    job_state = F\n    substate = 93\n") == "FAILED"
    assert pbs_mod.normalize("F") == "UNKNOWN"
