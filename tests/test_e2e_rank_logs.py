"""``per_rank_logs: true`` on the real SLURM: 2 nodes x 2 ranks, each rank's lines in its
own ``ranks/rank-NNNNN.log``, and ``hpc logs --grep`` naming the rank and node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.polling import wait_until
from tests.test_e2e_schedulers import PY, hpc, submit, wait_status, write_spec

pytestmark = pytest.mark.slurm

PROBE = """\
import os, sys
import ddp
r = ddp.init().rank
print(f"marker-out-{r}")
print(f"marker-err-{r}", file=sys.stderr)
ddp.barrier()
ddp.shutdown()
"""


def test_two_nodes_two_ranks_each_in_its_own_file(slurm_cluster: Any, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    runs = tmp_path / "runs"
    spec = write_spec(tmp_path / "r.yaml", [PY, str(probe)], nodes=2, ppn=2, per_rank_logs=True)
    job_id, run_dir = submit(str(spec), runs=runs)
    assert "export DDP_RANK_LOGS=1" in (run_dir / "job.slurm").read_text()
    assert wait_status(job_id, runs) == "COMPLETED"
    files = [run_dir / "ranks" / f"rank-{r:05d}.log" for r in range(4)]
    wait_until(
        lambda: all(
            f.is_file() and f"marker-err-{r}" in f.read_text() for r, f in enumerate(files)
        ),
        30,
        "every rank's lines",
    )
    for rank, path in enumerate(files):
        text = path.read_text()
        assert f"marker-out-{rank}" in text and f"marker-err-{rank}" in text
        others = [r for r in range(4) if r != rank]
        assert not any(f"marker-out-{r}" in text or f"marker-err-{r}" in text for r in others)
    # srun places ranks 0,1 on n1 and 2,3 on n2 (block distribution)
    hosts = {r: files[r].read_text().split(" on ", 1)[1].split()[0] for r in range(4)}
    assert hosts == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}, hosts
    found = hpc("logs", job_id, "--runs-dir", str(runs), "--grep", "marker-err-3")
    assert found.stdout.strip() == "rank 3 (n2): marker-err-3"
    assert "found in rank 3 (n2)" in found.stderr
    # the job log keeps rank 0's output and every rank's stderr
    log = "\n".join(p.read_text() for p in run_dir.glob("*.out"))
    assert "marker-out-0" in log and "marker-out-3" not in log and "marker-err-3" in log


def test_without_rank_files_the_merged_log_is_labelled(slurm_cluster: Any, tmp_path: Path) -> None:
    """per_rank_logs off: srun --label prefixes each line with its rank, and ``hpc logs
    --rank 1`` shows rank 1's lines only (2 nodes x 1 rank)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    runs = tmp_path / "runs"
    spec = write_spec(tmp_path / "l.yaml", [PY, str(probe)], nodes=2, ppn=1)
    job_id, run_dir = submit(str(spec), runs=runs)
    assert "srun --kill-on-bad-exit=1 --label " in (run_dir / "job.slurm").read_text()
    assert wait_status(job_id, runs) == "COMPLETED"
    log = "\n".join(p.read_text() for p in run_dir.glob("*.out"))
    for rank in (0, 1):
        assert f"{rank}: marker-out-{rank}" in log and f"{rank}: marker-err-{rank}" in log, log
    shown = hpc("logs", job_id, "--runs-dir", str(runs), "--rank", "1").stdout.splitlines()
    assert "marker-out-1" in shown and "marker-err-1" in shown, shown
    assert not any("marker-" in line and line.endswith("-0") for line in shown), shown
    found = hpc("logs", str(run_dir), "--grep", "marker-err-1")
    assert found.stdout.strip() == "rank 1 (?): marker-err-1" and "found in rank 1" in found.stderr
