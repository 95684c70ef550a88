"""``ddp.relaunch``: the mpiexec relaunch line, the host file, the launchers' reports of
a killed rank; and the supervisor under a PALS ``mpiexec`` on two emulated nodes (the
real OpenPBS run through ``hpc submit``: tests/test_e2e_resilience_pbs.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddp.relaunch import (
    Nodes,
    killed_nodes,
    match_hosts,
    mpiexec_command,
    mpiexec_layout,
    probe_prefix,
    read_hostfile,
)
from tests.ddp import _launch
from tests.ddp.test_supervise import WORKER, _spec, epoch_once_without_rank_1
from tests.support.parts import require_exe
from tests.support.polling import wait_until

BIND = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"
PALS = _launch.ROOT / "tests" / "support" / "pals" / "mpiexec"


def test_an_aurora_line_is_relaunched_on_fewer_nodes_with_its_own_flags_kept(
    tmp_path: Path,
) -> None:
    line = [
        "mpiexec",
        "-n",
        "24",
        "--ppn",
        "12",
        "--cpu-bind",
        BIND,
        "--label",
        "--line-buffer",
        "python",
        "-m",
        "ddp",
        "dpo",
        "-n",
        "3",
        "--ppn",
        "4",
    ]
    assert mpiexec_layout(line) == (24, 12, None)
    hf = tmp_path / "hostfile-2"
    assert mpiexec_command(line, hf, 1, 12) == [
        "mpiexec",
        "-n",
        "12",
        "--ppn",
        "12",
        "--hostfile",
        str(hf),
        "--cpu-bind",
        BIND,
        "--label",
        "--line-buffer",
        "python",
        "-m",
        "ddp",
        "dpo",
        "-n",
        "3",
        "--ppn",
        "4",
    ]


def test_hydra_spellings_and_two_value_options_survive_the_rewrite(tmp_path: Path) -> None:
    line = [
        "mpiexec.hydra",
        "-np",
        "4",
        "-ppn",
        "2",
        "-f",
        "old",
        "-genv",
        "A",
        "-x",
        "-prepend-rank",
        "--hostfile=older",
        "--",
        "t.py",
        "-f",
        "keep",
    ]
    assert mpiexec_layout(line) == (4, 2, "older")
    assert mpiexec_command(line, tmp_path / "h", 3, 2) == [
        "mpiexec.hydra",
        "-n",
        "6",
        "-ppn",
        "2",
        "--hostfile",
        str(tmp_path / "h"),
        "-genv",
        "A",
        "-x",
        "-prepend-rank",
        "--",
        "t.py",
        "-f",
        "keep",
    ]


def test_launcher_reports_name_the_killed_node_not_the_cascade() -> None:
    pals = [
        "x1.hsn.cm.aurora.alcf.anl.gov: rank 5 died from signal 15",
        "x2.hsn.cm.aurora.alcf.anl.gov: rank 7 died from signal 11",
        "x3.hsn.cm.aurora.alcf.anl.gov: shepherd died from signal 9",
        "x4: rank 9 died from signal 9",
        "x5: rank 1 exited with code 1",
    ]
    assert killed_nodes("mpiexec", pals) == ["x3.hsn.cm.aurora.alcf.anl.gov", "x4"]
    hydra = [
        "=" * 40,
        "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
        "=   PID 11453 RUNNING AT nodeB",
        "=   EXIT CODE: 9",
        "=   PID 2 RUNNING AT nodeC",
        "=   EXIT CODE: 1",
        "=   PID 3 RUNNING AT nodeD",
        "=   KILLED BY SIGNAL: 9 (Killed)",
    ]
    assert killed_nodes("mpiexec", hydra) == ["nodeB", "nodeD"]
    assert killed_nodes("srun", ["srun: error: n2: tasks 2-3: Killed"]) == ["n2"]
    assert killed_nodes("srun", hydra) == [] and killed_nodes("other", pals) == []
    hosts = ["x3.hostmgmt2000.cm.aurora.alcf.anl.gov", "x4.hostmgmt2000.cm.aurora.alcf.anl.gov"]
    assert match_hosts(["x3.hsn.cm.aurora.alcf.anl.gov", "x4", "x9"], hosts) == [*hosts, "x9"]


def test_the_host_file_is_read_as_untrusted_input(tmp_path: Path) -> None:
    good = tmp_path / "nodes"
    good.write_text("n1\nn1\n\n# a comment\nn2:4\n  n3  \n")
    assert read_hostfile(good) == ["n1", "n2", "n3"]
    for name, data in [("empty", b""), ("shell", b"n1\n$(rm -rf ~)\n"), ("binary", b"\x00\xff\n")]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ValueError, match="host file"):
            read_hostfile(path)
    with pytest.raises(ValueError, match="not a regular file"):
        read_hostfile(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):  # never blocks on open
        read_hostfile(fifo)


def test_nodes_from_pbs_nodefile_map_beats_by_node_index_and_take_spares(tmp_path: Path) -> None:
    nodefile = tmp_path / "PBS_NODEFILE"
    nodefile.write_text("a.x\na.x\nb.x\nc.x\n")  # PBS repeats a host per MPI process
    line = ["mpiexec", "-n", "6", "--ppn", "2", "python", "t.py"]  # 3 nodes, one spare
    nodes = Nodes.of(line, 1, {"PBS_NODEFILE": str(nodefile)})
    assert (nodes.kind, nodes.active, nodes.spares, nodes.per_node) == (
        "mpiexec",
        ["a.x", "b.x"],
        ["c.x"],
        2,
    )
    hf = tmp_path / "hostfile-1"
    assert nodes.command(line, hf)[:7] == [
        "mpiexec",
        "-n",
        "4",
        "--ppn",
        "2",
        "--hostfile",
        str(hf),
    ]
    assert hf.read_text() == "a.x\nb.x\n"
    assert nodes.node_of({"host": "same-host", "node_rank": 1}) == "b.x"  # emulated nodes
    assert nodes.node_of({"host": "a"}) == "a.x"  # gethostname without the domain
    assert nodes.leave_out(["b.x"], spares=1) and nodes.active == ["a.x", "c.x"]
    assert not nodes.leave_out(["a.x", "c.x"], spares=1)  # never every node
    assert nodes.command(line, hf)[:3] == ["mpiexec", "-n", "4"] and hf.read_text() == "a.x\nc.x\n"
    with pytest.raises(ValueError, match="--spares 4: the job has 3 nodes"):
        Nodes.of(line, 4, {"PBS_NODEFILE": str(nodefile)})
    assert Nodes.of(["torchrun", "t.py"], 0, {"PBS_NODEFILE": str(nodefile)}).kind == "other"
    with pytest.raises(ValueError, match="asks for 4 ranks but .* has 3 node"):
        Nodes.of(["mpiexec", "-n", "4", "t.py"], 0, {"PBS_NODEFILE": str(nodefile)})
    assert probe_prefix("mpiexec", line, "b.x", ["--no-vni"]) == [
        "mpiexec",
        "-n",
        "1",
        "--ppn",
        "1",
        "--hosts",
        "b.x",
        "--no-vni",
    ]


def test_an_unreadable_host_file_is_one_line_exit_2(tmp_path: Path) -> None:
    env = {**_launch.base_env(), "PBS_NODEFILE": str(tmp_path / "missing")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp.supervise",
            "--run-dir",
            str(tmp_path),
            "--",
            "mpiexec",
            "-n",
            "2",
            "true",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"supervise: error: host file {tmp_path / 'missing'}: not a regular file"
    ]


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.mpi
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_pals_mpiexec_node_lost_relaunches_on_the_other_with_a_rewritten_host_file(
    tmp_path: Path, sig: int
) -> None:
    """2 emulated nodes under the PALS shim (hydra's fork launcher runs both "hosts" of the
    host file here; PALS_NODEID tells the ranks apart); node 1's rank is SIGKILLed (hydra's
    report names nodeB) or SIGSTOPped (a hang: its beat's node index names nodeB) mid-epoch.
    The supervisor writes hostfile-2 without nodeB and the job completes on nodeA at half
    the world size, every sample of the epoch trained once."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    hold = tmp_path / "hold"
    hold.mkdir()
    spec = _spec(tmp_path, hold={"rank": 1, "step": 4, "dir": str(hold)})
    hosts = tmp_path / "nodefile"
    hosts.write_text("nodeA\nnodeB\n")
    env = {
        **_launch.base_env(),
        "PBS_NODEFILE": str(hosts),
        "HYDRA_LAUNCHER": "fork",
        "MASTER_ADDR": "127.0.0.1",
    }
    env.pop("HPC_RUN_DIR", None)
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "ddp.supervise",
        "--run-dir",
        str(run),
        "--poll-s",
        "0.1",
        "--max-restarts",
        "2",
        # 10 s: from rank 1's "ready" the test's poll, the SIGKILL and hydra's teardown
        # through the shim all come before the launcher's exit is seen, while rank 0's
        # clock runs from a beat up to a quarter timeout old (5 s was close under load)
        "--hang-timeout-s",
        "10",
        "--",
        str(PALS),
        "-n",
        "2",
        "--ppn",
        "1",
        "--label",
        sys.executable,
        WORKER,
        json.dumps(spec),
    ]
    proc = subprocess.Popen(
        cmd, env=env, cwd=_launch.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_until(
            lambda: (hold / "ready").exists(),
            120,
            "rank 1 (on nodeB) at step 4",
            ended=lambda: None if proc.poll() is None else f"exit {proc.returncode}",
        )
        os.kill(int((hold / "ready").read_text()), sig)
        if sig == signal.SIGSTOP:  # held until the hang is recorded: the stack dump
            # continues the rank for a moment, and released it would finish the epoch
            wait_until(
                lambda: "failure" in _text(run / "run.json"),
                120,
                "the hang seen",
                ended=lambda: None if proc.poll() is None else f"exit {proc.returncode}",
            )
        (hold / "released").touch()
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-5000:]
    assert "excluding node(s) nodeB; relaunching on nodeA" in out, out[-5000:]
    assert (run / "hostfile-1").read_text() == "nodeA\nnodeB\n"
    assert (run / "hostfile-2").read_text() == "nodeA\n"
    assert f"-n 1 --ppn 1 --hostfile {run / 'hostfile-2'} --label" in out
    events = json.loads((run / "run.json").read_text())["supervisor"]["events"]
    excl = [e for e in events if e["event"] == "exclude"]
    assert excl and excl[0]["nodes"] == ["nodeB"] and excl[0]["remaining"] == ["nodeA"], events
    failure = [e for e in events if e["event"] == "failure"][0]
    assert failure["kind"] == ("hang" if sig == signal.SIGSTOP else "exit"), failure
    if sig == signal.SIGSTOP:  # the stuck rank's stack shows where it waited
        assert "_index_worker.py" in (run / "failures" / "1" / "rank-1.txt").read_text()
    epoch_once_without_rank_1(tmp_path / "seen")


@pytest.mark.mpi
def test_nodes_whose_staged_unpack_failed_are_left_out_before_the_first_launch(
    tmp_path: Path,
) -> None:
    """``--staged MARKS`` (hpc.stage under resilience): nodeB left no mark, so the first
    attempt already runs on nodeA alone; with no mark at all the job does not start."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    hosts, marks, run = tmp_path / "nodefile", tmp_path / "marks", tmp_path / "run"
    hosts.write_text("nodeA.cm\nnodeB.cm\n")
    marks.mkdir()
    (marks / "nodeA").touch()  # as gethostname() or SLURMD_NODENAME spells it
    env = {**_launch.base_env(), "PBS_NODEFILE": str(hosts), "HYDRA_LAUNCHER": "fork"}
    cmd = [
        sys.executable,
        "-m",
        "ddp.supervise",
        "--run-dir",
        str(run),
        "--staged",
        str(marks),
        "--",
        str(PALS),
        "-n",
        "2",
        "--ppn",
        "1",
        sys.executable,
        "-c",
        "print('ran')",
    ]
    out = subprocess.run(
        cmd, env=env, cwd=_launch.ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ran") == 1 and (run / "hostfile-1").read_text() == "nodeA.cm\n"
    assert "excluding node(s) nodeB.cm: their python.stage unpack failed" in out.stderr
    events = json.loads((run / "run.json").read_text())["supervisor"]["events"]
    assert events[0]["event"] == "exclude" and events[0]["nodes"] == ["nodeB.cm"], events
    (marks / "nodeA").unlink()
    out = subprocess.run(
        cmd, env=env, cwd=_launch.ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1 and "ran" not in out.stdout, out.stderr
    assert "not starting: python.stage: the unpack failed on nodeA.cm,nodeB.cm" in out.stderr
