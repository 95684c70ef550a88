"""The environment fingerprint (``ddp.fingerprint``, ``hpc report``'s environment section).

Real 2-rank Gloo runs of the Trainer write ``env-JOBID.json``; two simulated nodes (one
rank each) with different loaded modules are told apart and the odd one named. The real
SLURM run with a changed package between submissions: tests/test_e2e_fingerprint.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ddp import fingerprint
from hpc import fingerprint as login
from tests.ddp import _launch

ROOT = _launch.ROOT
WORKER = str(ROOT / "tests/ddp/_train_worker.py")

#: Each rank names its node and, on node-1, loads one more module (as a node whose
#: image differs would), then runs the worker.
WRAP = """\
import os, runpy, sys
rank = os.environ["RANK"]
os.environ["SLURMD_NODENAME"] = "node-" + rank
os.environ["LOADEDMODULES"] = "frameworks/2025" + (":extra/1.0" if rank == "1" else "")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _spec(tmp: Path) -> str:
    return json.dumps(
        {
            "config": {
                "training": {"batch_size": 4, "epochs": 1, "seed": 1},
                "optim": {"name": "sgd", "lr": 0.1},
                "checkpoint": {"dir": str(tmp / "ck")},
                "logging": {"every_n_steps": 2, "progress": "off"},
            },
            "n": 16,
        }
    )


def _run(args: list[str], local_world: int | None = None, **env: str) -> None:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        procs = _launch.start(args, world=2, local_world=local_world)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for rank, (rc, o, e) in enumerate(_launch.finish(procs, timeout=120)):
        assert rc == 0, f"rank {rank} exit {rc}\n{o[-2000:]}\n{e[-3000:]}"


def test_two_ranks_write_one_fingerprint_without_secrets(tmp_path: Path) -> None:
    secrets = {
        "NCCL_AUTH_TOKEN": "s3cr3t-1",
        "CCL_PASSWORD": "s3cr3t-2",
        "FI_SECRET_KEY": "s3cr3t-3",
        "HF_TOKEN": "s3cr3t-4",
    }
    _run([WORKER, _spec(tmp_path)], NCCL_DEBUG="WARN", **secrets)
    (path,) = (tmp_path / "ck").glob("env-*.json")
    text = path.read_text()
    assert not any(v in text for v in secrets.values())
    assert not any(k in text for k in secrets)
    data = json.loads(text)
    assert data["world_size"] == 2 and data["env"]["NCCL_DEBUG"] == "WARN"
    assert data["software"]["packages"]["torch"] == data["software"]["devices"]["torch"]
    assert len(data["nodes"]) == 1 and data["nodes_differ"] == []
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # the test runs from a checkout: its commit was recorded
        assert data["git"]["commit"] == head.stdout.strip()


def test_a_node_with_other_software_is_named(tmp_path: Path) -> None:
    wrap = tmp_path / "wrap.py"
    wrap.write_text(WRAP)
    _run([str(wrap), WORKER, _spec(tmp_path)], local_world=1)
    (path,) = (tmp_path / "ck").glob("env-*.json")
    data = json.loads(path.read_text())
    assert sorted(data["nodes"]) == ["node-0", "node-1"]
    assert data["nodes"]["node-0"] != data["nodes"]["node-1"]
    # two nodes, one each: the tie goes to one hash; the other node is named
    assert len(data["nodes_differ"]) == 1 and data["nodes_differ"][0] in data["nodes"]
    lines = login.describe(tmp_path / "ck")
    assert any("other software" in line and data["nodes_differ"][0] in line for line in lines)


def test_variables_never_keep_a_secret_name() -> None:
    env = {
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5",
        "NCCL_API_KEY": "x",
        "SLURM_JOB_ID": "7",
        "CCL_AUTH": "x",
        "FI_CXI_PRIVATE": "x",
        "HOME": "/root",
        "AWS_SECRET_ACCESS_KEY": "x",
        "TORCH_CREDENTIALS": "x",
        "PBS_SESSION_ID": "x",
    }
    assert fingerprint.variables(env) == {
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5",
        "SLURM_JOB_ID": "7",
    }


@pytest.mark.parametrize(
    ("env", "job"),
    [
        ({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "2"}, "10_2"),
        ({"SLURM_JOB_ID": "12"}, "12"),
        ({"PBS_JOBID": "7[3].server"}, "7[3].server"),
    ],
)
def test_job_id_and_a_safe_file_name(env: dict[str, str], job: str) -> None:
    assert fingerprint.job_id(env) == job
    assert fingerprint.file_name("../../etc/x y") == "env-.._.._etc_x_y.json"
    assert (
        "/" not in fingerprint.file_name("a/" * 500) and len(fingerprint.file_name("a" * 999)) < 220
    )


def _rec(job: str, t: float, packages: dict[str, str], **extra: object) -> dict[str, object]:
    return {
        "job_id": job,
        "time": t,
        "nodes": {"n1": "h"},
        "nodes_differ": [],
        "software": {"python": "3.11.7", "modules": ["a"], "packages": packages},
        "env": {"NCCL_DEBUG": "INFO", "SLURM_JOB_ID": job},
        **extra,
    }


def test_report_lists_exactly_what_changed(tmp_path: Path) -> None:
    (tmp_path / "env-1.json").write_text(json.dumps(_rec("1", 1.0, {"torch": "2.13.0", "a": "1"})))
    (tmp_path / "env-2.json").write_text(
        json.dumps(_rec("2", 2.0, {"torch": "2.13.0", "a": "2", "b": "0.1"}))
    )
    lines = login.describe(tmp_path)
    assert lines[1] == "environment: job 1 -> job 2: 2 change(s)"
    assert lines[2:] == ["  package a: 1 -> 2", "  package b: + 0.1"]  # SLURM_JOB_ID: not a change
    # hostile files are skipped, never a traceback: a FIFO, a list, deep JSON, binary
    os.mkfifo(tmp_path / "env-fifo.json")
    (tmp_path / "env-list.json").write_text("[1, 2]")
    (tmp_path / "env-deep.json").write_text("[" * 100000)
    (tmp_path / "env-bin.json").write_bytes(b"\xff\xfe\x00")
    assert login.describe(tmp_path)[1:] == lines[1:]
