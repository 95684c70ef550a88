"""Issue 32 on the real OpenPBS server: a sweep wider than the server's ``max_array_size``
is several arrays of one sweep, as on SLURM (tests/test_e2e_sweep.py).

The server is shared by every PBS test on the machine: run this under the shared lock,
``flock /tmp/hpc-openpbs.lock python3 -m pytest -q tests/test_e2e_pbs_array_split.py``.
The test lowers ``max_array_size`` to 5 (as root, ``qmgr``) for its own duration and puts
the old value back in the fixture's teardown, whatever the test did.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.openpbs import FINAL, OpenPBS
from tests.support.parts import require_exe
from tests.test_e2e_pbs import Hpc, hpc, log_of  # noqa: F401 - fixture

pytestmark = pytest.mark.pbs

LIMIT = 5
N = 12  # arrays of 5, 5 and 2: the split of the test at a size this machine runs


@pytest.fixture
def small_max_array_size(openpbs: OpenPBS) -> Iterator[int]:
    """The server's ``max_array_size`` set to :data:`LIMIT`, the old value (or none)
    restored after the test."""
    import os

    if os.geteuid() != 0:
        pytest.skip("setting max_array_size needs the PBS manager (root here)")
    listed = openpbs.run("qmgr", "-c", "list server max_array_size").stdout
    found = re.search(r"max_array_size\s*=\s*([0-9]+)", listed)
    openpbs.run("qmgr", "-c", f"set server max_array_size={LIMIT}")
    try:
        yield LIMIT
    finally:
        restore = (
            f"set server max_array_size={found.group(1)}"
            if found
            else "unset server max_array_size"
        )
        openpbs.run("qmgr", "-c", restore)


def test_qsub_refuses_an_array_over_the_limit(
    small_max_array_size: int, openpbs: OpenPBS, tmp_path: Path
) -> None:
    """What the split avoids: ``-J 0-5`` (6 subjobs) at 5 is refused at submit; the limit
    is on the count, so ``-J 10-14`` passes. Both held (``-h``) and deleted at once."""
    script = tmp_path / "t.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    over = openpbs.run(
        "qsub", "-h", "-J", "0-5", "-l", "walltime=00:01:00", str(script), check=False
    )
    assert over.returncode != 0
    assert "Array job exceeds server or queue size limit" in over.stderr, over.stderr
    fits = openpbs.run("qsub", "-h", "-J", "10-14", "-l", "walltime=00:01:00", str(script))
    openpbs.run("qdel", fits.stdout.strip(), check=False)
    single = openpbs.run(
        "qsub", "-h", "-J", "0-0", "-l", "walltime=00:01:00", str(script), check=False
    )
    assert single.returncode != 0 and "illegal -J value" in single.stderr, single.stderr


def test_sweep_wider_than_max_array_size_is_one_sweep_of_three_arrays(
    small_max_array_size: int,
    hpc: Hpc,  # noqa: F811
    openpbs: OpenPBS,
    tmp_path: Path,
) -> None:
    """12 tasks at max_array_size 5 (read by ``hpc submit`` from ``qstat -Bf``): arrays of
    5, 5 and 2 that all run, each task its own sweep point (``$HPC_SWEEP_OFFSET`` from
    ``qsub -v`` + ``PBS_ARRAY_INDEX``); ``run.json`` holds the three arrays and ``hpc
    status`` shows one sweep of 12 task lines; ``hpc logs`` finds a task of the third."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    started = time.monotonic()
    proc = hpc(
        "submit",
        "--cluster",
        "pbs",
        "--name",
        "wide",
        "--runs-dir",
        str(hpc.runs),
        "--walltime",
        "00:05:00",
        "--sweep",
        "optim.lr=" + ",".join(str(i) for i in range(N)),
        "--",
        "bash",
        "-c",
        'echo "point $HPC_SWEEP_INDEX: $*" | tee "$HPC_RUN_DIR/point.txt"',
        "x",
    )
    job_id = proc.stdout.strip()
    (run_dir,) = hpc.runs.iterdir()
    parts = json.loads((run_dir / "run.json").read_text())["array_parts"]
    hpc.submitted += [p["job_id"] for p in parts[1:]]
    assert (
        f"hpc: {N} tasks exceed the cluster's array size ({LIMIT}, max_array_size): one "
        "sweep of 3 arrays" in proc.stderr
    )
    assert [(p["offset"], p["count"]) for p in parts] == [(0, 5), (5, 5), (10, 2)]
    assert parts[0]["job_id"] == job_id and len({p["job_id"] for p in parts}) == 3
    assert "#PBS -J 0-4\n" in (run_dir / "job.pbs").read_text()
    # the third array's own -J (qsub's command line wins over the script's #PBS -J 0-4)
    third = openpbs.attrs(parts[2]["job_id"])
    assert third.get("array_indices_submitted") == "0-1", third
    assert str((third.get("Variable_List") or {}).get("HPC_SWEEP_OFFSET")) == "10", third

    deadline = time.monotonic() + 240  # a bound against a hang only
    while True:
        lines = hpc("status", str(run_dir), "--runs-dir", str(hpc.runs)).stdout.splitlines()
        tasks = [ln.split() for ln in lines[1:]]
        if len(tasks) == N and all(t[1] in FINAL for t in tasks):
            break
        assert time.monotonic() < deadline, (lines, log_of(run_dir))
        time.sleep(1)
    print(f"{N} tasks in 3 arrays: {time.monotonic() - started:.1f} s from submit to all ended")
    assert lines[0].split()[:2] == [job_id, "COMPLETED"], lines[0]
    ids = []
    for part in parts:
        seq, rest = part["job_id"].split("[]")
        ids += [f"{seq}[{i}]{rest}" for i in range(part["count"])]
    assert [t[0] for t in tasks] == ids
    assert [t[1] for t in tasks] == ["COMPLETED"] * N, (lines, log_of(run_dir))
    assert [t[2] for t in tasks] == [f"optim.lr={i}" for i in range(N)]
    for i in range(N):  # each task ran its own point
        (task_dir,) = run_dir.glob(f"{i:03d}-*")
        assert (task_dir / "point.txt").read_text() == f"point {i}: --set optim.lr={i}\n"
    log = hpc("logs", ids[-1], "--runs-dir", str(hpc.runs)).stdout
    assert "point 11: --set optim.lr=11" in log, log
