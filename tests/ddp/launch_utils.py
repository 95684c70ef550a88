"""Helpers for the real multi-process launcher tests: run a command, read every rank's record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus every launcher variable a test process might inherit."""
    prefixes = ("SLURM_", "PMI_", "PALS_", "OMPI_", "MPI_LOCAL", "PBS_", "TORCHELASTIC_")
    names = {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "DDP_LAUNCHER",
    }
    env = {k: v for k, v in os.environ.items() if k not in names and not k.startswith(prefixes)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def records(out: Path, world: int) -> list[dict]:
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in recs] == list(range(world))
    return recs


def assert_torchrun_like(recs: list[dict], nodes: int) -> None:
    """ddp.exec gave the script torchrun's environment: elastic launch, GROUP_WORLD_SIZE."""
    assert all(r["elastic"] for r in recs), "is_torchelastic_launched() was False"
    assert {r["group_world_size"] for r in recs} == {nodes}


def assert_consistent(recs: list[dict]) -> None:
    """All ranks ended with the same weights and reduce_mean gave the true mean of rank+1."""
    world = len(recs)
    assert len({r["digest"] for r in recs}) == 1, "ranks ended with different weights"
    expected = sum(range(1, world + 1)) / world
    for r in recs:
        assert r["world_size"] == world
        assert abs(r["reduce_mean"] - expected) < 1e-6


PY = sys.executable
