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
        "123.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"
    )
    assert get("pbs").parse_job_id("55\n") == "55"
    for name in ("slurm", "pbs"):
        with pytest.raises(SchedulerError, match="no job id"):
            get(name).parse_job_id("error: nope\n")


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("PENDING", "PENDING"),
        ("CONFIGURING", "RUNNING"),
        ("COMPLETING", "RUNNING"),
        ("COMPLETED", "COMPLETED"),
        ("CANCELLED by 0", "CANCELLED"),
        ("CANCELLED+", "CANCELLED"),
        ("TIMEOUT", "TIMEOUT"),
        ("NODE_FAIL", "FAILED"),
        ("OUT_OF_MEMORY", "FAILED"),
        ("PREEMPTED", "PREEMPTED"),
        ("REQUEUED", "PENDING"),
        ("WEIRD", "UNKNOWN"),
        ("", "UNKNOWN"),
    ],
)
def test_slurm_normalize(raw: str, state: str) -> None:
    assert slurm_mod.normalize(raw) == state
    assert state in STATES


@pytest.mark.parametrize(
    ("letter", "code", "state"),
    [
        ("Q", None, "PENDING"),
        ("H", None, "PENDING"),
        ("R", None, "RUNNING"),
        ("E", None, "RUNNING"),
        ("F", 0, "COMPLETED"),
        ("F", 1, "FAILED"),
        ("F", -29, "TIMEOUT"),
        ("F", 271, "CANCELLED"),
        ("Z", None, "UNKNOWN"),
    ],
)
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
    fake_bin(
        "sacct",
        """if [ "$1" = "-c" ]; then echo '12|COMPLETED'; else
echo 'Slurm accounting storage is disabled' >&2; exit 1; fi""",
    )
    fake_bin("scontrol", "exit 1")
    assert get("slurm").status("12") == "COMPLETED"
    log = fake_bin.log.read_text()
    assert "sacct -X -n -P -j 12 -o JobID,State" in log
    assert "sacct -c -n -P -j 12 -o JobID,State" in log


def test_slurm_status_asks_scontrol_before_sacct(fake_bin) -> None:
    fake_bin("squeue", "exit 0")
    fake_bin("sacct", "echo 'accounting storage is disabled'; exit 0")
    fake_bin("scontrol", "echo 'JobId=12 JobName=x'; echo '   JobState=TIMEOUT Reason=TimeLimit'")
    assert get("slurm").status("12") == "TIMEOUT"


def test_slurm_status_of_a_requeued_job_is_its_latest_run(fake_bin) -> None:
    """The jobcomp log holds one record a run: the first REQUEUED, the last the outcome."""
    fake_bin("squeue", "exit 0")
    fake_bin("scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    fake_bin(
        "sacct",
        """if [ "$1" = "-c" ]; then printf '12|REQUEUED\n12|COMPLETED\n'; else
echo 'Slurm accounting storage is disabled' >&2; exit 1; fi""",
    )
    assert get("slurm").status("12") == "COMPLETED"


def test_pbs_status_falls_back_to_plain_qstat(fake_bin) -> None:
    fake_bin(
        "qstat",
        """if [ "$1" = "-x" ]; then echo 'qstat: invalid option -- x' >&2; exit 2; fi
printf 'Job Id: 3.s\\n    job_state = Q\\n'""",
    )
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


def test_scancel_that_exits_0_with_an_error_line_is_a_refusal(fake_bin) -> None:
    """What SLURM 22.05's scancel -v really says for an unknown id (exit 0; without -v it
    says nothing at all): tests/test_e2e_clients.py checks it on the real cluster."""
    fake_bin(
        "scancel",
        'echo "scancel: Terminating job $2" >&2; echo "scancel: error: Kill job '
        'error on job id $2: Invalid job id specified" >&2; exit 0',
    )
    with pytest.raises(SchedulerError, match="Invalid job id specified") as info:
        get("slurm").cancel("99999999")
    assert "\n" not in str(info.value)
    assert "scancel -v 99999999" in fake_bin.log.read_text()


def test_scancel_that_says_nothing_but_terminating_is_a_success(fake_bin) -> None:
    fake_bin("scancel", 'echo "scancel: Terminating job $2" >&2; exit 0')
    get("slurm").cancel("7")


NOT_UTF8 = r"printf 'caf\xe9 \xff\xfe\n'"


@pytest.mark.parametrize("name", ["sbatch", "qsub"])
def test_a_submit_refusal_that_is_not_utf8_is_one_line(name, fake_bin, tmp_path) -> None:
    fake_bin(name, f"{NOT_UTF8} >&2; exit 1")
    with pytest.raises(SchedulerError) as info:
        get("slurm" if name == "sbatch" else "pbs").submit(str(tmp_path / "x"), str(tmp_path))
    assert "caf\ufffd \ufffd\ufffd" in str(info.value) and "\n" not in str(info.value)


def test_status_output_that_is_not_utf8_is_read(fake_bin) -> None:
    """A job name or variable in Latin-1 inside qstat's or squeue's answer."""
    fake_bin("qstat", r"""printf '{"Jobs": {"3.s": {"job_state": "R", "Job_Name": "caf\xe9"}}}'""")
    assert get("pbs").status("3.s") == "RUNNING"
    fake_bin("squeue", r"printf '4|4|RUNNING\n'; printf 'caf\xe9\n' >&2")
    assert get("slurm").status("4") == "RUNNING"
