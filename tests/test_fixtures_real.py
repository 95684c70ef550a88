"""The real-part fixtures themselves work: SLURM jobs, the PALS shim, the namespace pair.

Why: every scheduler/launcher test builds on these; a broken fixture must show up here,
with a clear reason, rather than as a confusing failure in a launcher test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.netns import NetnsPair
from tests.support.pals import pbs_env
from tests.support.slurm import SlurmCluster


def _env0(path: Path) -> dict[str, str]:
    """Parse ``env -0`` output (values may hold newlines)."""
    items = path.read_bytes().decode().split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


@pytest.mark.slurm
def test_slurm_trivial_job_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    assert os.environ["SLURM_CONF"] == str(slurm_cluster.conf)
    job = slurm_cluster.submit(
        _script(tmp_path / "hello.sh", 'echo "hello $1 from $SLURM_JOB_ID"\n'), "world"
    )
    assert slurm_cluster.wait(job, timeout=60) == "COMPLETED"
    assert slurm_cluster.output_path(job).read_text().strip() == f"hello world from {job}"


@pytest.mark.slurm
def test_a_second_cluster_in_this_process_leaves_the_first_running(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A test module's own cluster (tests/test_e2e_sweep.py's MaxArraySize=11 one) once
    took the session's cluster, owned by this same live process, for a stale one: it
    killed its daemons, and its teardown dropped the session's /etc/hosts line."""
    from tests.support.slurm import HOSTS_FILE, start_cluster

    with start_cluster() as second:
        assert second.root != slurm_cluster.root and slurm_cluster.root.is_dir()
    assert slurm_cluster.nodes_idle(), slurm_cluster.log_tail()
    assert f"{os.getpid()}:{slurm_cluster.root.name}" in HOSTS_FILE.read_text()
    job = slurm_cluster.submit(_script(tmp_path / "after.sh", "#SBATCH -N2 -n2\nsrun hostname\n"))
    assert slurm_cluster.wait(job, timeout=60) == "COMPLETED", slurm_cluster.log_tail()


@pytest.mark.slurm
@pytest.mark.multinode
def test_slurm_srun_spans_both_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = _script(
        tmp_path / "span.sh",
        """\
        #SBATCH -N2 -n2
        srun bash -c 'echo "nodeid=$SLURM_NODEID node=$SLURMD_NODENAME rank=$SLURM_PROCID"'
        """,
    )
    job = slurm_cluster.submit(script)
    assert slurm_cluster.wait(job, timeout=60) == "COMPLETED"
    lines = sorted(slurm_cluster.output_path(job).read_text().split("\n"))
    lines = [ln for ln in lines if ln]
    assert lines == ["nodeid=0 node=n1 rank=0", "nodeid=1 node=n2 rank=1"]


@pytest.mark.slurm
def test_slurm_scancel_running_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = slurm_cluster.submit(_script(tmp_path / "long.sh", "sleep 120\n"))
    assert slurm_cluster.wait(job, states=("RUNNING",), timeout=60) == "RUNNING"
    slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait(job, timeout=30) == "CANCELLED"


@pytest.mark.slurm
def test_slurm_test_only(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = _script(tmp_path / "t.sh", "#SBATCH -N2 -n4\ntrue\n")
    res = slurm_cluster.run("sbatch", "--test-only", str(script), check=False)
    assert res.returncode == 0, res.stderr
    # e.g. "sbatch: Job 7 to start at 2026-... using 4 processors on nodes n[1-2] in partition debug"
    assert "to start at" in res.stderr


@pytest.mark.mpi
def test_pals_shim_sets_rank_variables(pals_mpiexec: Path, tmp_path: Path) -> None:
    env = {**os.environ, **pbs_env(tmp_path)}
    env["PATH"] = f"{pals_mpiexec}{os.pathsep}{env['PATH']}"
    argv = [
        "mpiexec",
        "-n",
        "2",
        "--ppn",
        "2",
        "--cpu-bind",
        "list:1:2",
        "--depth",
        "1",
        "--envall",
        "--env",
        "HPCDDP_MARK=1",
        "--no-vni",
        "--line-buffer",
        "sh",
        "-c",
        'env -0 > "$PBS_O_WORKDIR/env.$PMI_RANK"',  # a file per rank: stdout would interleave
    ]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    ranks = [_env0(tmp_path / f"env.{i}") for i in range(2)]
    for i, e in enumerate(ranks):
        ids = (e["PMI_RANK"], e["PALS_RANKID"], e["PMI_LOCAL_RANK"], e["PALS_LOCAL_RANKID"])
        assert ids == (str(i),) * 4
        assert (e["PMI_SIZE"], e["PMI_LOCAL_SIZE"], e["PALS_NODEID"]) == ("2", "2", "0")
        assert e["PALS_SHIM_CPU_BIND"] == "list:1:2" and e["PALS_SHIM_DEPTH"] == "1"
        assert e["HPCDDP_MARK"] == "1" and e["PBS_JOBID"] == env["PBS_JOBID"]  # env passed
    assert ranks[0]["PALS_APID"] == ranks[1]["PALS_APID"] != ""
    nodefile = Path(env["PBS_NODEFILE"]).read_text().split()
    assert nodefile == [os.uname().nodename]


@pytest.mark.mpi
def test_pals_shim_rejects_unknown_flag(pals_mpiexec: Path) -> None:
    res = subprocess.run(
        [str(pals_mpiexec / "mpiexec"), "--bogus", "1", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2 and "unsupported option" in res.stderr


@pytest.mark.multinode
def test_netns_pair_tcp(netns_pair: NetnsPair) -> None:
    a, b = netns_pair.addresses
    assert (a, b) == ("10.200.0.1", "10.200.0.2")
    server_code = textwrap.dedent(f"""\
        import socket
        s = socket.create_server(("{b}", 0))
        print(s.getsockname()[1], flush=True)
        c, peer = s.accept()
        c.sendall(("hello " + peer[0]).encode())
        c.close()
        """)
    server = netns_pair.run(1, [sys.executable, "-c", server_code], stdout=subprocess.PIPE)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    client_code = (
        f"import socket; c = socket.create_connection(('{b}', {port}), timeout=10); "
        "print(c.recv(100).decode())"
    )
    out = netns_pair.check_output(0, [sys.executable, "-c", client_code])
    assert out.strip() == f"hello {a}"
    assert server.wait(timeout=10) == 0
    # the veths live only inside the namespaces, not in the host's stack
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not any(v in host_links for v in netns_pair.veths)


def test_a_pyenv_lock_is_cleared_only_when_no_rehash_owns_it(tmp_path: Path) -> None:
    """A PBS job killed during its login shell's ``pyenv rehash`` leaves pyenv's lock file,
    and every later job then waited 60 s before its script (tests/support/openpbs.py):
    the PBS fixtures remove the lock, but never while a ``pyenv-rehash`` process lives."""
    from tests.support.openpbs import clear_stale_pyenv_lock
    from tests.support.polling import wait_until

    lock = tmp_path / "shims" / ".pyenv-shim"
    assert clear_stale_pyenv_lock(lock) is False  # no lock: nothing to do
    lock.parent.mkdir()
    lock.write_text("#!/usr/bin/env bash\n")
    env = dict(os.environ, PYENV_ROOT=str(tmp_path))  # as pyenv exports it to its rehash
    owner = subprocess.Popen(["bash", "-c", "exec -a pyenv-rehash sleep 60"], env=env)
    try:
        cmdline = Path(f"/proc/{owner.pid}/cmdline")
        wait_until(lambda: cmdline.read_bytes().startswith(b"pyenv-rehash"), 30, "exec")
        assert clear_stale_pyenv_lock(lock) is False and lock.is_file()  # a rehash owns it
    finally:
        owner.kill()
        owner.wait()
    assert clear_stale_pyenv_lock(lock) is True and not lock.exists()  # its owner is gone
