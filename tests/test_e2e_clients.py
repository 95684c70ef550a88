"""The scheduler clients against the real SLURM and the real OpenPBS (issue 24): what
``scancel``/``qdel`` answer for an id they do not know, and answers that are not UTF-8.

SLURM is the private 22.05 cluster of tests/support/slurm.py; OpenPBS is the shared
23.06 server of tests/support/openpbs.py (/opt/pbs/bin first on PATH).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpc.cli import main
from hpc.errors import SchedulerError
from hpc.schedulers import get
from tests.support.openpbs import OpenPBS

UNKNOWN = "99999999"


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpc: error: "), captured
    assert "cancel requested" not in captured.out
    return lines[0]


# --- SLURM ----------------------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.parametrize("job_id", [UNKNOWN, f"{UNKNOWN}_3"])
def test_slurm_cancel_of_an_unknown_job_is_one_line_and_fails(
    job_id: str,
    slurm_cluster,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """scancel exits 0 and prints nothing for an unknown id; "cancel requested", exit 0,
    was a lie."""
    assert main(["cancel", job_id, "--cluster", "slurm", "--runs-dir", str(tmp_path)]) == 3
    assert "Invalid job id specified" in _error(capsys)


@pytest.mark.slurm
def test_slurm_cancel_of_an_ended_job_says_so(
    slurm_cluster,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = tmp_path / "true.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    job_id = slurm_cluster.submit(script)
    assert slurm_cluster.wait(job_id) == "COMPLETED"
    assert main(["cancel", job_id, "--cluster", "slurm", "--runs-dir", str(tmp_path)]) == 3
    line = _error(capsys)
    assert job_id in line and ("completed" in line or "Invalid job id" in line)


@pytest.mark.slurm
def test_slurm_submit_refusal_that_is_not_utf8_is_one_line(slurm_cluster, tmp_path: Path) -> None:
    """sbatch echoes a partition name in Latin-1 back (``invalid partition specified:
    caf\\xe9`` on its first line): a UnicodeDecodeError before."""
    script = tmp_path / "job.slurm"
    script.write_bytes(b"#!/bin/bash\n#SBATCH --partition=caf\xe9\ntrue\n")
    proc = subprocess.run(
        ["sbatch", str(script)], env=slurm_cluster.env, capture_output=True, check=False, timeout=60
    )  # bytes: no decoding here
    assert b"caf\xe9" in proc.stderr  # the real sbatch answers with the raw byte
    with pytest.raises(SchedulerError) as info:
        get("slurm").submit(str(script), str(tmp_path))
    assert "Invalid partition name specified" in str(info.value)
    assert "\n" not in str(info.value)


# --- OpenPBS --------------------------------------------------------------------------


@pytest.mark.pbs
def test_pbs_cancel_of_an_unknown_job_is_one_line_and_fails(
    openpbs: OpenPBS,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["cancel", UNKNOWN, "--cluster", "pbs", "--runs-dir", str(tmp_path)]) == 3
    assert "Unknown Job Id" in _error(capsys)


@pytest.mark.pbs
def test_pbs_status_of_a_job_whose_attributes_are_not_utf8(
    openpbs: OpenPBS,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job variable in Latin-1 comes back raw in ``qstat -f -F json``: hpc status gave
    a UnicodeDecodeError traceback."""
    script = tmp_path / "held.pbs"
    script.write_text("#!/bin/bash\ntrue\n")

    def client(*argv: str | bytes) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [str(openpbs.bin / str(argv[0])), *argv[1:]],
            capture_output=True,
            check=False,
            timeout=60,
        )  # bytes: the fixture's helpers decode

    proc = client(
        "qsub", "-h", "-l", "walltime=00:01:00", "-v", b"HPC_TEST_VAR=caf\xe9", str(script)
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.decode().strip()
    try:
        raw = client("qstat", "-x", "-f", "-F", "json", job_id)
        assert b"caf\xe9" in raw.stdout  # the server really answers with the raw byte
        assert main(["status", job_id, "--cluster", "pbs", "--runs-dir", str(tmp_path)]) == 0
        assert capsys.readouterr().out == f"{job_id} PENDING\n"  # held
    finally:  # -x: out of the shared server's history too, where its byte would reach
        client("qdel", "-x", "-W", "force", job_id)  # every other test that lists all jobs


@pytest.mark.pbs
def test_pbs_submit_refusal_that_is_not_utf8_is_one_line(openpbs: OpenPBS, tmp_path: Path) -> None:
    script = tmp_path / "job.pbs"
    script.write_bytes(b"#!/bin/bash\n#PBS -q caf\xe9\ntrue\n")
    with pytest.raises(SchedulerError) as info:
        get("pbs").submit(str(script), str(tmp_path))
    assert "caf\ufffd" in str(info.value) and "\n" not in str(info.value)
