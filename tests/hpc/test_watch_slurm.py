"""``hpc status RUN --watch`` on the real SLURM (the test cluster), through a pipe.

A short Trainer job (tests/ddp/_train_worker.py, 8 steps a rank): the watch ends on
its own when the job does, with the job's exit status, having printed each line only
when it changed and the trainer's last metrics. Ctrl-C (SIGINT) on a watch of a held
job ends the watch with 130 and leaves the job queued. The waits are on the watch's
own end and its first line, each bounded only against a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.signals import default_signals
from tests.test_e2e_schedulers import PY, ROOT, WORKER, status, submit, worker_spec, write_spec

pytestmark = pytest.mark.slurm


def _watch(ident: str, runs: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    return subprocess.Popen(
        [sys.executable, "-m", "hpc", "status", ident, "--runs-dir", str(runs), "--watch"],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_signals,  # Ctrl-C must reach it even from a backgrounded run
    )


def test_watch_through_a_pipe_ends_with_the_job(slurm_cluster: Any, tmp_path: Path) -> None:
    spec = worker_spec(tmp_path)
    runs = tmp_path / "runs"
    job_id, run_dir = submit(
        str(write_spec(tmp_path / "w.yaml", [PY, WORKER, json.dumps(spec)])), runs=runs
    )
    proc = _watch(str(run_dir), runs)
    out, err = proc.communicate(timeout=240)  # the watch ends by itself when the job does
    assert proc.returncode == 0, (out, err)
    lines = out.splitlines()
    assert lines[0].startswith(f"job {job_id} ") and lines[-1] == f"job {job_id} COMPLETED"
    assert err.strip().endswith("hpc: job ended: COMPLETED")
    assert len(set(lines)) == len(lines), lines  # a pipe gets a line only when it changes
    last = [
        json.loads(x)
        for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"step"' in x and json.loads(x).get("kind", "train") == "train"
    ][-1]
    assert f"metrics step {last['step']} loss " in out, out
    assert f"slowest rank {int(last['slowest_rank'])}" in lines, lines


def test_ctrl_c_leaves_the_watch_with_130_and_the_job_queued(
    slurm_cluster: Any, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    spec = write_spec(tmp_path / "h.yaml", ["true"], directives=["--hold"])
    job_id, run_dir = submit(str(spec), runs=runs)
    try:
        proc = _watch(str(run_dir), runs)
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the watch is up: its first look printed
        assert first.strip() == f"job {job_id} PENDING", first
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "the job was not touched" in err, err
        assert status(job_id, runs) == "PENDING"
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
