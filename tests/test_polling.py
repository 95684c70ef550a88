"""Waits on a job end when the job ends and quote its log (issue 24: a job that died at
its first line was reported as "both ranks at step 3: not after 120 s")."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.polling import JobEnded, wait_state, wait_until


def _job(tmp_path: Path, code: int) -> tuple[subprocess.Popen[bytes], Path]:
    """A 'job' that logs an error and exits at once, never writing what the test waits for."""
    log = tmp_path / "job.log"
    body = f"import sys; print('ModuleNotFoundError: No module named torch'); sys.exit({code})"
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-c", body], stdout=fh)
    return proc, log


def test_a_wait_on_what_a_job_does_ends_with_the_job_and_quotes_its_log(tmp_path: Path) -> None:
    proc, log = _job(tmp_path, 1)
    start = time.monotonic()
    with pytest.raises(JobEnded) as info:
        wait_until(
            (tmp_path / "ready").exists,
            120,
            "both ranks at step 3",
            ended=lambda: None if proc.poll() is None else f"exit {proc.returncode}",
            log=log.read_text,
        )
    assert time.monotonic() - start < 60  # the bound is 120 s: it did not run out
    message = str(info.value)
    assert message.startswith("both ranks at step 3: the job ended (exit 1) first")
    assert "No module named torch" in message


def test_a_wait_for_a_state_ends_on_another_final_state(tmp_path: Path) -> None:
    proc, log = _job(tmp_path, 2)

    def state() -> str:
        return "RUNNING" if proc.poll() is None else "FAILED"

    with pytest.raises(
        JobEnded, match=r"(?s)the job ended \(FAILED\) first.*No module named torch"
    ):
        wait_state(state, ("COMPLETED",), ("COMPLETED", "FAILED"), 120, "job done", log.read_text)
    assert wait_state(state, ("FAILED",), ("FAILED",), 120, "job failed", log.read_text) == "FAILED"


def test_a_timeout_names_the_last_state_and_quotes_the_log(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("step 1\nstep 2\n")
    with pytest.raises(
        TimeoutError, match=r"(?s)job done: not after 0.2 s \(last state RUNNING\).*step 2"
    ):
        wait_state(
            lambda: "RUNNING", ("COMPLETED",), ("COMPLETED",), 0.2, "job done", log.read_text
        )
