"""``hpc submit --chain 3`` on the real OpenPBS server (tests/support/openpbs.py): the
walltime ends segment 1 mid-training (the trainer saves at SIGTERM and exits 75),
segment 2 resumes from that checkpoint and finishes (exit 0: ``chain.done``), segment 3
ends at once without launching anything, and ``hpc status`` lists all three."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.parts import require_exe
from tests.test_e2e_pbs import WORKER, Hpc, _worker_spec, hpc, log_of  # noqa: F401 - fixture

pytestmark = pytest.mark.pbs


def _log(run_dir: Path, job_id: str) -> str:
    """The log of one segment (PBS names it by the job's sequence number)."""
    seq = job_id.split(".")[0]
    return "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob(f"{seq}*.OU")))


@pytest.mark.timeout(400)
def test_chain_crosses_the_walltime(hpc: Hpc, tmp_path: Path) -> None:  # noqa: F811 - fixture
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    ready = tmp_path / "ready"
    ready.mkdir()
    # Segment 1 holds at step 3 until a signal: only the walltime's SIGTERM moves it on
    # (wait_timeout is far past the walltime). Segment 2 resumes past step 3 and runs on.
    spec = _worker_spec(tmp_path, wait_signal_step=3, ready_dir=str(ready), wait_timeout=600)
    job_file = tmp_path / "chain.yaml"
    job_file.write_text(
        yaml.safe_dump(
            {
                "name": "chain",
                "cluster": "pbs",
                "nodes": 1,
                "ppn": 2,
                "walltime": "00:00:40",
                "wrap": "never",
                "env": {"OMP_NUM_THREADS": "1"},
                "command": ["python", WORKER, json.dumps(spec)],
            }
        )
    )
    first, run_dir = hpc.submit(str(job_file), "--chain", "3")
    record = json.loads((run_dir / "run.json").read_text())
    ids = [s["job_id"] for s in record["chain"]]
    assert len(ids) == 3 and ids[0] == first
    hpc.submitted += ids[1:]
    hpc.wait_for(run_dir, lambda: len(list(ready.glob("*.pid"))) == 2, "segment 1 at step 3")
    assert not (run_dir / "chain.done").exists()

    def all_final() -> bool:
        lines = hpc("status", str(run_dir)).stdout.splitlines()[1:]
        return len(lines) == 3 and all(
            x.split()[1] in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED") for x in lines
        )

    from tests.support.polling import wait_until

    wait_until(all_final, 300, "every segment ended", log=lambda: log_of(run_dir))
    lines = hpc("status", str(run_dir)).stdout.splitlines()
    assert [x.split()[0] for x in lines[1:]] == ids
    states = [x.split()[1] for x in lines[1:]]
    assert states == ["TIMEOUT", "COMPLETED", "COMPLETED"], lines
    assert [x.split(None, 2)[2] for x in lines[1:]] == [f"segment {k}/3" for k in (1, 2, 3)]
    one, two, three = (_log(run_dir, j) for j in ids)
    assert "walltime" in one and "preemption signal" in one, one
    assert "resuming from" in two and "chain.done" not in two, two
    assert "training finished in an earlier segment" in three, three
    assert "Initialized DDP" not in three and "resuming from" not in three, three
    assert (run_dir / "chain.done").is_file()
    assert (tmp_path / "final.pt").is_file()


def test_after_an_array_is_accepted_by_the_real_server(
    hpc: Hpc,  # noqa: F811
    openpbs,
    tmp_path: Path,
) -> None:
    """``--after 12[].server:any``: the real qsub takes the plain ``afterany`` on an
    array's id (Torque's ``afteranyarray`` it refuses), and the job waits on it."""
    script = tmp_path / "t.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    array = openpbs.run(
        "qsub", "-h", "-J", "0-1", "-l", "walltime=00:01:00", str(script)
    ).stdout.strip()
    hpc.submitted.append(array)
    job_id, _ = hpc.submit(
        "--cluster",
        "pbs",
        "--walltime",
        "00:01:00",
        "--wrap",
        "never",
        "--after",
        f"{array}:any",
        "--",
        "true",
    )
    attrs = openpbs.attrs(job_id)
    assert str(attrs["depend"]).startswith(f"afterany:{array}"), attrs
    assert attrs["job_state"] == "H", attrs  # held on the array, not run
