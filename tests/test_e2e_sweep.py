"""A sweep on the real SLURM: one job array, a folder, metrics and a line of ``hpc status``
per task, and ``hpc report`` overlaying the tasks (issue 17's done-when)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED")

pytestmark = pytest.mark.slurm


def hpc(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([PY, "-m", "hpc", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"hpc {args}: {proc.returncode}\n{proc.stdout}{proc.stderr}"
    return proc


def test_sweep_of_two_learning_rates_is_one_array(slurm_cluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    # Constant lr, no scaling: the lr each task logs is exactly the one it was given.
    job_id = hpc(
        "submit", "jobs/uniref50.yaml", "--queue", "debug", "--runs-dir", str(runs),
        "--sweep", "optim.lr=0.002,0.02",
        "--", "python", "-m", "ddp", "uniref50", "--config", "configs/uniref50-tiny.yaml",
        "--set", "optim.schedule=constant", "optim.warmup_steps=0", "scaling.rule=none",
        "training.max_steps=6", "logging.every_n_steps=2",
    ).stdout.strip()
    assert job_id.isdigit(), job_id  # one array job, not two jobs
    (run_dir,) = runs.iterdir()
    script = (run_dir / "job.slurm").read_text()
    assert "#SBATCH --array=0-1\n" in script and "%x-%A_%a.out" in script

    deadline = time.monotonic() + 240
    while True:
        lines = hpc("status", str(run_dir), "--runs-dir", str(runs)).stdout.splitlines()
        tasks = [ln.split() for ln in lines[1:]]
        if len(tasks) == 2 and all(t[1] in FINAL for t in tasks):
            break
        assert time.monotonic() < deadline, (lines, [p.read_text(errors="replace")[-4000:]
                                                     for p in sorted(run_dir.glob("*.out"))])
        time.sleep(0.5)
    logs = "\n".join(p.read_text(errors="replace") for p in run_dir.glob("*.out"))
    assert [t[0] for t in tasks] == [f"{job_id}_0", f"{job_id}_1"]
    assert [t[1] for t in tasks] == ["COMPLETED", "COMPLETED"], logs
    assert [t[2] for t in tasks] == ["optim.lr=0.002", "optim.lr=0.02"]

    for task, lr in (("000-lr-0.002", 0.002), ("001-lr-0.02", 0.02)):
        records = [json.loads(ln) for ln in (run_dir / task / "metrics.jsonl").read_text().splitlines()]
        lrs = [r["lr"] for r in records if "lr" in r]
        assert lrs and lrs == pytest.approx([lr] * len(lrs)), (task, records)
        assert (run_dir / task / "checkpoints" / "uniref50" / "final" / "model.pt").is_file()

    hpc("report", str(run_dir))
    from hpc.report import report  # the same call, to see what the PNG was drawn from

    result = report([run_dir], tmp_path / "again.png")
    assert sorted(result.labels) == ["optim.lr=0.002", "optim.lr=0.02"]
    assert all(len(s.values("loss")) >= 2 for s in result.series)
    png = run_dir / "report.png"
    import matplotlib.image as mpimg

    image = mpimg.imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[0] > 300 and image.shape[1] > 300
