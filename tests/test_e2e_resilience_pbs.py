"""``resilience:`` on the real OpenPBS with the Aurora profile: the job carries
``-W tolerate_node_failures=all``, its PALS ``mpiexec`` runs under ``ddp.supervise``, the
rank on the second node is SIGKILLed mid-epoch, and the job finishes on the first node
alone, in the same allocation, through a rewritten host file (ALCF's "Working around node
failures" recipe, done by the supervisor).

Emulated here (tests/test_e2e_pbs.py says why): the server has one pbs_mom, whose
``$PBS_NODEFILE`` names the same host once per vnode, so the job's ``setup`` line points
``PBS_NODEFILE`` at a file naming two nodes, as a real 2-node Aurora allocation's does; the
PALS shim (``module load frameworks``) runs both through hydra's fork launcher and gives
each rank its PALS_NODEID. Everything else (qsub, the directive, the job's environment,
the supervisor, the relaunch, the resume) is the real thing.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from tests.ddp.test_supervise import WORKER, _spec, epoch_once_without_rank_1
from tests.support.parts import require_exe
from tests.support.ports import free_port
from tests.test_e2e_pbs import ROOT, Hpc, hpc, log_of  # noqa: F401 - fixture

pytestmark = pytest.mark.pbs


@pytest.mark.timeout(400)
def test_aurora_job_with_resilience_survives_a_lost_node(
    hpc: Hpc,  # noqa: F811 - fixture
    lmod_frameworks: Path,
    tmp_path: Path,
) -> None:
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    hold = tmp_path / "hold"
    hold.mkdir()
    spec = _spec(tmp_path, hold={"rank": 1, "step": 4, "dir": str(hold)})
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(
        "x4102c5s0b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov\n"
        "x4102c5s1b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov\n"
    )
    job_file = tmp_path / "res.yaml"
    job_file.write_text(
        yaml.safe_dump(
            {
                "name": "res",
                "cluster": "aurora",
                "nodes": 2,
                "ppn": 1,
                "queue": "debug",
                "account": "testproj",
                "walltime": "00:05:00",
                "resilience": True,
                "setup": [f"export PBS_NODEFILE={nodefile}"],
                "env": {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(free_port()),
                    "OMP_NUM_THREADS": "1",
                },
                "command": ["python", str(ROOT / WORKER), json.dumps(spec)],
            }
        )
    )
    job_id, run_dir = hpc.submit(str(job_file))
    script = next(run_dir.glob("job*.pbs")).read_text()
    assert "#PBS -W tolerate_node_failures=all" in script
    assert (
        "-m ddp.supervise --hang-timeout-s=600 --max-restarts=3 --min-nodes=1 --spares=0 "
        "--concurrent-args=--no-vni -- mpiexec -n 2 --ppn 1" in script
    )
    hpc.wait_for(run_dir, lambda: (hold / "ready").exists(), "rank 1 (second node) at step 4")
    os.kill(int((hold / "ready").read_text()), signal.SIGKILL)  # both "nodes" are this host
    (hold / "released").touch()
    assert hpc.wait(run_dir, timeout=240) == "COMPLETED", log_of(run_dir)
    log = log_of(run_dir)
    first, second = (x.strip() for x in nodefile.read_text().splitlines())
    assert f"excluding node(s) {second}; relaunching on {first}" in log, log[-5000:]
    assert (run_dir / "hostfile-2").read_text() == f"{first}\n"
    events = json.loads((run_dir / "run.json").read_text())["supervisor"]["events"]
    excl = [e for e in events if e["event"] == "exclude"]
    assert excl and excl[0]["nodes"] == [second], events
    assert events[-1]["event"] == "completed", events
    epoch_once_without_rank_1(tmp_path / "seen")
    status = hpc("status", str(run_dir), "--runs-dir", str(hpc.runs))
    assert status.stdout.split("\n")[0].split()[-1] == "COMPLETED"
    assert second in status.stderr, status.stderr  # the restart and the excluded node
