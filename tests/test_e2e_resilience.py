"""``resilience:`` through ``hpc submit`` on the real SLURM: the rendered job runs with
``--no-kill`` and its srun under ``python -m ddp.supervise``; n2's rank is killed mid-epoch
and the job finishes alone on n1, in the same allocation, with every sample trained once.
(The supervisor itself around a hand-written script: tests/ddp/test_supervise.py.)"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.ddp.test_supervise import WORKER, _spec, epoch_once_without_rank_1
from tests.support.polling import wait_until
from tests.support.ports import free_port
from tests.test_e2e_schedulers import PY, ROOT, ended, hpc, log_of, submit, wait_status, write_spec

pytestmark = pytest.mark.slurm


def test_hpc_submit_with_resilience_survives_a_lost_node(
    slurm_cluster: Any, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.mkdir()
    spec = _spec(tmp_path, hold={"rank": 1, "step": 4, "dir": str(hold)})
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
        "MASTER_PORT": str(free_port()),
    }  # every private test cluster starts at job 1
    path = write_spec(
        tmp_path / "res.yaml",
        [PY, str(ROOT / WORKER), json.dumps(spec)],
        nodes=2,
        ppn=1,
        env=env,
        resilience={"hang_timeout_s": 60, "max_restarts": 2},
    )
    runs = tmp_path / "runs"
    job_id, run_dir = submit(str(path), runs=runs)
    script = (run_dir / "job.slurm").read_text()
    assert "#SBATCH --no-kill" in script
    assert "-m ddp.supervise --hang-timeout-s=60 --max-restarts=2 --min-nodes=1" in script
    wait_until(
        lambda: (hold / "ready").exists(),
        120,
        "rank 1 (on n2) at step 4",
        ended=lambda: ended(job_id, runs),
        log=lambda: log_of(run_dir),
    )
    os.kill(int((hold / "ready").read_text()), signal.SIGKILL)  # n2 shares this host here
    (hold / "released").touch()
    assert wait_status(job_id, runs, timeout=240) == "COMPLETED", log_of(run_dir)
    assert "excluding node(s) n2; relaunching on n1" in log_of(run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["job_id"] == job_id  # hpc's record kept beside the supervisor's events
    events = record["supervisor"]["events"]
    assert [e for e in events if e["event"] == "exclude"][0]["nodes"] == ["n2"], events
    # every sample of the epoch trained exactly once: the steps up to the checkpoint the
    # relaunch resumed from (step 4) on both ranks, then the relaunch alone on n1
    epoch_once_without_rank_1(tmp_path / "seen")
    assert hpc("status", job_id, "--runs-dir", str(runs)).stdout.split()[-1] == "COMPLETED"
