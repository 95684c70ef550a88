"""``hpc submit --chain 2`` on the real SLURM test cluster (tests/support/slurm.py): the
time limit's SIGTERM ends segment 1 mid-training (the trainer saves, exits 75), segment 2
(``--dependency=afterany``) resumes from that checkpoint and finishes; ``hpc status``
lists both segments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.polling import wait_until
from tests.test_e2e_schedulers import (
    FINAL,
    PY,
    WORKER,
    hpc,
    log_of,
    submit,
    worker_spec,
    write_spec,
)

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(400)
def test_chain_of_two_crosses_the_time_limit(slurm_cluster, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    # segment 1 idles inside step 3 until the time limit's SIGTERM (wait_timeout is past it)
    spec = worker_spec(tmp_path, wait_signal_step=3, ready_dir=str(ready), wait_timeout=300)
    spec["config"]["preemption"]["requeue"] = False  # the chain is what goes on, not a requeue
    job_file = write_spec(
        tmp_path / "chain.yaml", [PY, WORKER, json.dumps(spec)], walltime="00:01:00"
    )
    runs = tmp_path / "runs"
    first, run_dir = submit(str(job_file), "--chain", "2", runs=runs)
    ids = [s["job_id"] for s in json.loads((run_dir / "run.json").read_text())["chain"]]
    assert len(ids) == 2 and ids[0] == first

    def lines() -> list[str]:
        return hpc("status", str(run_dir), "--runs-dir", str(runs)).stdout.splitlines()[1:]

    wait_until(
        lambda: all(x.split()[1] in FINAL for x in lines()),
        300,
        "both segments ended",
        log=lambda: log_of(run_dir),
    )
    got = lines()
    assert [x.split()[0] for x in got] == ids
    assert got[1].split()[1] == "COMPLETED" and got[0].split()[1] in ("TIMEOUT", "FAILED"), got
    assert [x.split(None, 2)[2] for x in got] == ["segment 1/2", "segment 2/2"]
    log = log_of(run_dir)
    assert "preemption signal" in log and "resuming from" in log and "done: steps=8" in log, log
    assert (run_dir / "chain.done").is_file()
