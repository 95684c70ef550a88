"""Node-hours used (issue 31 item 4) on the real SLURM: `hpc report RUN` sums sacct's
allocation times of both submissions of a run (a short job, then `submit --resume`)."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.test_e2e_schedulers import PY, WORKER, hpc, submit, wait_status, worker_spec, write_spec

pytestmark = pytest.mark.slurm


def _sacct_node_hours(job_id: str) -> float:
    """The expected figure, from sacct itself (End - Start) x NNodes."""
    # -c: the test cluster has no accounting database, only its jobcomp file
    out = subprocess.run(
        ["sacct", "-c", "-j", job_id, "-X", "-n", "-P", "-o", "Start,End,NNodes"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    start, end, nodes = out.splitlines()[0].split("|")
    secs = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    return secs * int(nodes) / 3600.0


def test_report_totals_node_hours_of_a_resumed_run(slurm_cluster: Any, tmp_path: Path) -> None:
    runs = tmp_path / "runs"

    def spec_with(max_steps: int) -> Path:
        spec = worker_spec(tmp_path)
        spec["config"]["checkpoint"]["dir"] = "ck"
        spec["config"]["training"]["max_steps"] = max_steps
        return write_spec(tmp_path / f"r{max_steps}.yaml", [PY, WORKER, json.dumps(spec)])

    job1, run_dir = submit(str(spec_with(3)), runs=runs)
    assert wait_status(job1, runs) == "COMPLETED"
    job2 = hpc(
        "submit", "--runs-dir", str(runs), "--resume", str(run_dir), str(spec_with(6))
    ).stdout.strip()
    assert re.fullmatch(r"\d+", job2), job2  # stdout: the job id alone
    assert wait_status(job2, runs) == "COMPLETED"
    out = hpc("report", str(run_dir), "-o", str(tmp_path / "r.png")).stdout
    want = _sacct_node_hours(job1) + _sacct_node_hours(job2)
    assert f"job {job1}: 1 nodes" in out and f"job {job2}: 1 nodes" in out
    total = re.search(r"total: ([0-9.e+-]+) node-hours used over 2 submission", out)
    assert total, out
    assert float(total.group(1)) == pytest.approx(want, rel=1e-4)
    per = re.search(r"per 1,000 completed steps: ([0-9.e+-]+) node-hours \((\d+) steps\)", out)
    assert per, out
    assert float(per.group(1)) == pytest.approx(want * 1000 / int(per.group(2)), rel=1e-3)
