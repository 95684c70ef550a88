"""Start N local ranks as plain subprocesses with torchrun's variables (Gloo, CPU).

Cheaper than torchrun (no agent process) and lets a test signal or time each rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.pop("SLURM_JOB_ID", None)
    return env


def start(
    args: list[str], world: int = 2, local_world: int | None = None
) -> list[subprocess.Popen]:
    """Start ``python ARGS`` once per rank; returns the processes in rank order.

    ``local_world``: ranks per simulated node (default: all on one), as torchrun numbers
    them (node ``rank // local_world``, local rank ``rank % local_world``)."""
    port = free_port()
    local = local_world or world
    procs = []
    for rank in range(world):
        env = base_env()
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank % local),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(local),
            GROUP_RANK=str(rank // local),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 60.0) -> list[tuple[int, str, str]]:
    """Wait for every rank (killing all at the deadline); (returncode, stdout, stderr) each."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            o, e = p.communicate()
            e += f"\n[test harness: killed at the {timeout:.0f}s deadline]"
        out.append((p.returncode, o, e))
    return out


def run(args: list[str], world: int = 2, timeout: float = 60.0) -> list[tuple[int, str, str]]:
    return finish(start(args, world), timeout)
