"""Start-up of a 2-node job's ranks with and without the venv staged to node-local
storage (``python: {venv: P, stage: always}``, ``hpc.stage``), on the test SLURM
cluster (tests/support/slurm.py: two slurmd as nodes n1/n2 on this machine).

Measured, for each arm, with what ``hpc submit`` renders (nothing hand-written):

- time from the batch script's start (a profile ``setup`` line, which runs before the
  environment is activated or staged) to rank 0's first finished training step
  (``import torch, ddp``; ``ddp.init``; one forward/backward/step of a small MLP);
- the file-system calls each rank makes on paths inside the shared venv, counted with
  ``strace -f -e trace=%file`` around the rank in a separate run (strace slows start-up,
  so the timed runs go without it).

The venv holds torch itself (``pip install torch==2.13.0`` into it, from the local
wheel when there is one), as a user's venv does. A projection to 1,000 nodes x 12 ranks
multiplies the per-rank calls; staged, the shared file system serves the pack's read
once per job (sbcast reads it on the first node).

Usage: ``python bench/stage.py [--rounds 3] [--venv /tmp/hpc-ddp-bench-venv]``
(root, SLURM installed: the same needs as the SLURM tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import slurm  # noqa: E402

RANK = r"""
import os, sys, time
import torch, ddp
ctx = ddp.init()
model = ddp.wrap(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(8, 64)).pow(2).mean()
loss.backward(); opt.step()
if ctx.rank == 0:
    print(f"FIRST_STEP {time.time():.3f} prefix={sys.prefix}", flush=True)
ddp.shutdown()
"""


def make_venv(where: Path) -> Path:
    """A venv with torch inside it (not reached through the system's site folders)."""
    if (where / "bin" / "python").exists() and subprocess.run(
        [str(where / "bin" / "python"), "-c", "import torch"], capture_output=True
    ).returncode == 0:
        return where
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0", "numpy", "pyyaml"], check=True)
    purelib = subprocess.run(
        [
            str(where / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "hpc-ddp-checkout.pth").write_text(f"{ROOT / 'src'}\n")
    return where


def profile(dir_: Path) -> Path:
    """The slurm profile plus a first line that stamps the script's start."""
    (dir_ / "clusters").mkdir(parents=True, exist_ok=True)
    (dir_ / "clusters" / "benchslurm.yaml").write_text(
        yaml.safe_dump(
            {
                "extends": "slurm",
                "description": "bench/stage.py",
                "setup": ['date +%s.%N > "/tmp/hpc-ddp-bench-t0-$SLURM_JOB_ID"'],
            }
        )
    )
    return dir_ / "clusters"


def run_job(tmp: Path, venv: Path, stage: str, strace: bool, env: dict[str, str]) -> dict:
    rank = tmp / "rank.py"
    rank.write_text(RANK)
    command = ["python", str(rank)]
    if strace:
        command = [
            "bash",
            "-c",
            "exec strace -f -qq -e trace=%file -o "
            f'{shlex.quote(str(tmp))}/trace-"$SLURM_PROCID".txt python '
            f"{shlex.quote(str(rank))}",
        ]
    spec = tmp / f"stage-{stage}.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": f"bench-{stage}",
                "cluster": "benchslurm",
                "queue": "debug",
                "nodes": 2,
                "ppn": 1,
                "walltime": "00:10:00",
                "wrap": "never",
                "python": {"venv": str(venv), "stage": stage},
                "env": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
                "command": command,
            }
        )
    )
    runs = tmp / "runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    proc = subprocess.run(
        [sys.executable, "-m", "hpc", "submit", str(spec), "--runs-dir", str(runs)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    job_id = proc.stdout.strip()
    (run_dir,) = set(runs.iterdir()) - before
    deadline = time.monotonic() + 600
    while True:
        state = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env
        ).stdout
        match = re.search(r"JobState=(\S+)", state)
        if match and match.group(1) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id} did not end: {state}")
        time.sleep(0.2)
    log = "\n".join(p.read_text() for p in run_dir.glob("*.out"))
    if match.group(1) != "COMPLETED":
        raise SystemExit(f"job {job_id} {match.group(1)}:\n{log}")
    t0 = float(Path(f"/tmp/hpc-ddp-bench-t0-{job_id}").read_text())
    first = float(re.search(r"FIRST_STEP (\S+)", log).group(1))
    packed = re.search(r"in ([0-9.]+) s;", proc.stderr)
    out = {
        "job": job_id,
        "start_to_first_step_s": round(first - t0, 3),
        "pack_at_submit_s": float(packed.group(1)) if packed else None,
        "prefix": re.search(r"prefix=(\S+)", log).group(1),
    }
    if strace:
        shared = str(venv)
        calls = []
        for trace in sorted(tmp.glob("trace-*.txt")):
            lines = trace.read_text(errors="replace").splitlines()
            calls.append(sum(1 for line in lines if f'"{shared}/' in line or f'"{shared}"' in line))
            trace.unlink()
        out["shared_venv_calls_per_rank"] = calls
    for path in Path("/tmp").glob(f"hpc-ddp-env-{job_id}*"):
        subprocess.run(["rm", "-rf", str(path)], check=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--venv", type=Path, default=Path("/tmp/hpc-ddp-bench-venv"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stage.json")
    args = parser.parse_args()
    venv = make_venv(args.venv)
    tmp = Path(f"/tmp/hpc-ddp-bench-stage-{os.getpid()}")
    tmp.mkdir()
    tar_mb = (
        sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6
    )
    with slurm.start_cluster() as cluster:
        env = dict(
            os.environ,
            SLURM_CONF=str(cluster.conf),
            HPC_DDP_CLUSTERS=str(profile(tmp)),
            PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'src'}",
        )
        env.pop("VIRTUAL_ENV", None)
        results: dict[str, dict] = {}
        for stage in ("never", "always"):
            timed = [run_job(tmp, venv, stage, False, env) for _ in range(args.rounds)]
            traced = run_job(tmp, venv, stage, True, env)
            results[stage] = {
                "start_to_first_step_s": [t["start_to_first_step_s"] for t in timed],
                "median_s": statistics.median(t["start_to_first_step_s"] for t in timed),
                "prefix": timed[0]["prefix"],
                "pack_at_submit_s": [t["pack_at_submit_s"] for t in timed],
                "shared_venv_calls_per_rank": traced["shared_venv_calls_per_rank"],
            }
    per_rank = statistics.median(results["never"]["shared_venv_calls_per_rank"])
    staged = statistics.median(results["always"]["shared_venv_calls_per_rank"])
    summary = {
        "venv_mb": round(tar_mb, 1),
        "load_average": os.getloadavg()[0],
        "arms": results,
        "time_ratio_staged_over_shared": round(
            results["always"]["median_s"] / results["never"]["median_s"], 2
        ),
        "projection_1000_nodes_x_12_ranks": {
            "shared_metadata_calls_unstaged": int(per_rank * 12 * 1000),
            "shared_metadata_calls_staged": int(staged * 12 * 1000) + 1,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
