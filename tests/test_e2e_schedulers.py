"""End to end on real schedulers: rendered jobs run DDP training to completion, survive
preemption, fail fast, span two nodes; the Aurora PBS script runs as PBS would run it.

SLURM is a real 22.05 cluster started by tests/support/slurm.py (two emulated nodes);
PBS Pro and PALS do not exist here, so the Aurora path runs the rendered script with the
variables PBS sets and the PALS-compatible mpiexec shim (tests/support/pals/) over MPICH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.ddp import _launch
from tests.support.openpbs import PBS_BIN
from tests.support.pals import pbs_env
from tests.support.parts import require
from tests.support.polling import wait_state, wait_until

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
WORKER = str(ROOT / "tests/ddp/_train_worker.py")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL")

pytestmark = pytest.mark.slurm


def hpc(
    *args: str, cwd: Path = ROOT, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess, as a user runs it (SLURM_CONF comes from the fixture)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(
        [PY, "-m", "hpc", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    if check:
        assert proc.returncode == 0, f"hpc {args}: {proc.returncode}\n{proc.stdout}{proc.stderr}"
    return proc


def submit(*args: str, runs: Path, env: dict[str, str] | None = None) -> tuple[str, Path]:
    """`hpc submit ...`: the job id it prints and the run directory it made."""
    before = set(runs.iterdir()) if runs.exists() else set()
    job_id = hpc("submit", "--runs-dir", str(runs), *args, env=env).stdout.strip()
    assert job_id.isdigit(), job_id
    (run_dir,) = set(runs.iterdir()) - before
    return job_id, run_dir


def status(job_id: str, runs: Path) -> str:
    return hpc("status", job_id, "--runs-dir", str(runs)).stdout.split()[-1]


def wait_status(job_id: str, runs: Path, states=FINAL, timeout: float = 150) -> str:
    """Poll `hpc status` until the job reaches one of ``states`` (no fixed sleeps); a job
    that ends in another state ends the wait at once, and a failure quotes its log."""
    return wait_state(
        lambda: status(job_id, runs),
        states,
        FINAL,
        timeout,
        f"job {job_id} in {states}",
        log=lambda: "\n".join(log_of(d) for d in sorted(runs.iterdir())),
    )


def ended(job_id: str, runs: Path) -> str | None:
    """The job's final state once it has one (for waits on what the job does)."""
    state = status(job_id, runs)
    return state if state in FINAL and state != "PREEMPTED" else None


def log_of(run_dir: Path) -> str:
    logs = sorted(run_dir.glob("*.out"))
    return "\n".join(p.read_text(errors="replace") for p in logs)


def worker_spec(tmp: Path, **extra) -> dict:
    """A small deterministic Trainer run (tests/ddp/_train_worker.py), 8 steps a rank."""
    spec = {
        "config": {
            "training": {"batch_size": 4, "epochs": 1, "shuffle": True, "seed": 3},
            "optim": {"name": "sgd", "lr": 0.1},
            "checkpoint": {"dir": str(tmp / "ck")},
            "logging": {"every_n_steps": 2, "progress": "plain"},
            "preemption": {"signals": ["SIGUSR1", "SIGTERM"], "requeue": True},
        },
        "n": 64,
        "out": str(tmp / "final.pt"),
    }
    spec.update(extra)
    return spec


def write_spec(path: Path, command: list[str], **fields) -> Path:
    data = {
        "name": "e2e",
        "cluster": "slurm",
        "queue": "debug",
        "nodes": 1,
        "ppn": 2,
        "walltime": "00:05:00",
        "wrap": "never",
        "command": command,
        "env": {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"},
    }
    data.update(fields)
    path.write_text(yaml.safe_dump(data))
    return path


#: jobs/uniref50.yaml trains SEDD small at the seed's values (a GPU job); on the test
#: cluster's CPUs it runs as checked in with configs/uniref50-tiny.yaml's sizes, given
#: through DDP_SET as a user would (python -m ddp reads it before its --set).
TINY = {
    "DDP_SET": "model.d_model=64 model.n_layers=2 model.n_heads=4 model.cond_dim=32 "
    "model.max_len=64 model.dropout=0.0 training.batch_size=8 training.accum=1 "
    "optim.lr=5e-3 optim.warmup_steps=10 precision=fp32 "
    "memory.max_memory_fraction=null data.num_workers=0 "
    "monitoring.sample_frequency=0 checkpoint.every_n_steps=0"
}


def scratch(tmp: Path) -> Path:
    """A site $SCRATCH as jobs/uniref50.yaml expects it (seed 004's layout): the shipped
    tiny FASTA as data/uniref50.fasta.gz, as download-uniref50 leaves it."""
    import gzip

    from ddp.recipes import DATA_DIR

    root = tmp / "scratch"
    (root / "data").mkdir(parents=True)
    data = (DATA_DIR / "uniref50_tiny.fasta").read_bytes()
    (root / "data" / "uniref50.fasta.gz").write_bytes(gzip.compress(data, mtime=0))
    return root


# ------------------------------------------------------------------------- SLURM


def test_hpc_submit_uniref50_runs_to_completion(slurm_cluster, tmp_path):
    runs = tmp_path / "runs"
    site = scratch(tmp_path)
    job_id, run_dir = submit(
        "jobs/uniref50.yaml", "--queue", "debug", runs=runs, env={"SCRATCH": str(site), **TINY}
    )
    assert wait_status(job_id, runs) == "COMPLETED", log_of(run_dir)
    log = log_of(run_dir)
    assert "Initialized DDP: rank=0, world_size=2, local_rank=0" in log
    assert re.search(r"done: steps=\d+, train_loss=", log), log
    # the spec's --work_dir $SCRATCH/experiments, expanded by the job's shell
    final = site / "experiments" / "final" / "model.pt"
    assert final.is_file() and (final.parent / "config.yaml").is_file()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["job_id"] == job_id and record["git_commit"]


def test_plain_sbatch_of_checked_in_script(slurm_cluster, tmp_path):
    """`sbatch jobs/uniref50.slurm` works as checked in (log and checkpoints redirected)."""
    out = tmp_path / "plain.out"
    site = scratch(tmp_path)
    env = dict(os.environ, HPC_RUN_DIR=str(tmp_path), SCRATCH=str(site), **TINY)
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}", "jobs/uniref50.slurm"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job_id = proc.stdout.strip().split(";")[0]
    state = slurm_cluster.wait(job_id, timeout=150)
    assert state == "COMPLETED", out.read_text()
    assert "world_size=2" in out.read_text()
    assert (site / "experiments" / "final" / "model.pt").is_file()


def test_two_nodes_srun(slurm_cluster, tmp_path):
    """The same recipe job over both emulated nodes: srun -N2, one rank on each."""
    runs = tmp_path / "runs"
    job_id, run_dir = submit(
        "jobs/uniref50.yaml",
        "--queue",
        "debug",
        "--nodes",
        "2",
        "--ppn",
        "1",
        runs=runs,
        env={"SCRATCH": str(scratch(tmp_path)), **TINY},
    )
    assert wait_status(job_id, runs) == "COMPLETED", log_of(run_dir)
    script = (run_dir / "job.slurm").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "world_size=2" in log_of(run_dir)
    nodes = slurm_cluster.run("sacct", "-c", "-n", "-X", "-P", "-j", job_id, "-o", "NodeList")
    assert "n[1-2]" in nodes.stdout or ("n1" in nodes.stdout and "n2" in nodes.stdout)


def test_cancel_running_job(slurm_cluster, tmp_path):
    runs = tmp_path / "runs"
    job_id, _ = submit(
        "--cluster",
        "slurm",
        "--queue",
        "debug",
        "--ppn",
        "1",
        "--walltime",
        "00:05:00",
        "--",
        "sleep",
        "300",
        runs=runs,
    )
    wait_status(job_id, runs, states=("RUNNING",), timeout=60)
    hpc("cancel", job_id, "--runs-dir", str(runs))
    assert wait_status(job_id, runs, timeout=60) == "CANCELLED"


def test_crashing_rank_ends_job_promptly(slurm_cluster, tmp_path):
    spec = worker_spec(tmp_path, fail_rank=1, fail_step=3)
    job_file = write_spec(tmp_path / "crash.yaml", [PY, WORKER, json.dumps(spec)])
    runs = tmp_path / "runs"
    start = time.monotonic()
    job_id, run_dir = submit(str(job_file), runs=runs)
    assert wait_status(job_id, runs, timeout=90) == "FAILED"
    assert time.monotonic() - start < 60
    log = log_of(run_dir)
    assert "rank 1 failed: RuntimeError: injected failure" in log


def test_preempted_job_requeues_resumes_and_matches(slurm_cluster, tmp_path):
    """SIGUSR1 mid-epoch -> one checkpoint -> scontrol requeue -> resume -> same weights."""
    ready = tmp_path / "ready"
    ready.mkdir()
    # wait_timeout: the ranks idle in step 3 until the USR1 (the worker's default, 30 s,
    # is shorter than a loaded machine may take between their pid files and the signal)
    spec = worker_spec(tmp_path, wait_signal_step=3, ready_dir=str(ready), wait_timeout=240)
    job_file = write_spec(
        tmp_path / "pre.yaml", [PY, WORKER, json.dumps(spec)], requeue=True, signal="USR1@60"
    )
    runs = tmp_path / "runs"
    job_id, run_dir = submit(str(job_file), runs=runs)
    # both ranks sit inside step 3; preempt them the way SLURM does (signal the tasks)
    wait_until(
        lambda: len(list(ready.glob("*.pid"))) == 2,
        90,
        "ranks at step 3",
        ended=lambda: ended(job_id, runs),
        log=lambda: log_of(run_dir),
    )
    slurm_cluster.run("scancel", "--signal=USR1", job_id)
    # rank 0 checkpoints and runs `scontrol requeue`; the job comes back PENDING with a
    # BeginTime (~2 min on this cluster), which we release at once
    wait_until(
        lambda: (
            "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job_id, check=False).stdout
        ),
        90,
        "requeue",
        ended=lambda: ended(job_id, runs),
        log=lambda: log_of(run_dir),
    )
    deadline = time.monotonic() + 150
    state = status(job_id, runs)
    while state not in ("COMPLETED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, f"job {job_id} still {state}\n{log_of(run_dir)}"
        if state == "PENDING":  # held by its BeginTime until the requeue settles
            slurm_cluster.release(job_id)
        time.sleep(0.5)
        state = status(job_id, runs)
    assert state == "COMPLETED", log_of(run_dir)
    log = log_of(run_dir)
    assert "requeued SLURM job" in log and "resuming from" in log
    resumed = torch.load(tmp_path / "final.pt", weights_only=False)["state"]

    # the same run, never interrupted
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref_spec = worker_spec(ref_dir)
    results = _launch.run([WORKER, json.dumps(ref_spec)], world=2, timeout=120)
    assert [r[0] for r in results] == [0, 0], results
    reference = torch.load(ref_dir / "final.pt", weights_only=False)["state"]
    assert resumed.keys() == reference.keys()
    for k in reference:
        assert torch.equal(resumed[k], reference[k]), k


@pytest.mark.slow
def test_walltime_leaves_usable_checkpoint(slurm_cluster, tmp_path):
    """At the time limit SLURM sends SIGTERM (then SIGKILL after KillWait): the trainer
    saves in between, so the next job can resume."""
    ready = tmp_path / "ready"
    ready.mkdir()
    spec = worker_spec(tmp_path, wait_signal_step=2, ready_dir=str(ready), wait_timeout=300)
    spec["config"]["preemption"]["requeue"] = False
    job_file = write_spec(
        tmp_path / "wall.yaml", [PY, WORKER, json.dumps(spec)], walltime="00:01:00"
    )
    runs = tmp_path / "runs"
    job_id, run_dir = submit(str(job_file), runs=runs)
    # the worker idles inside step 2 until the limit hits
    assert wait_status(job_id, runs, timeout=180) in ("TIMEOUT", "FAILED", "CANCELLED")
    from ddp import checkpoint

    found = checkpoint.load_latest(str(tmp_path / "ck"))
    assert found is not None, log_of(run_dir)
    path, state = found
    assert state["global_step"] >= 2 and "model" in state, path


# ------------------------------------------------------------------------- PBS / Aurora


def _aurora_two_ranks(tmp_path: Path) -> Path:
    """jobs/dpo_aurora.yaml rendered for 1 node x 2 ranks: only the counts differ from the
    checked-in jobs/dpo_aurora.pbs (2 x 12 ranks do not fit a 2-core machine)."""
    script = tmp_path / "dpo_aurora_2.pbs"
    hpc(
        "render",
        "jobs/dpo_aurora.yaml",
        "--nodes",
        "1",
        "--ppn",
        "2",
        "--queue",
        "debug",
        "--no-account",
        "-o",
        str(script),
    )
    # ppn 2 <= 6 GPUs: one rank per GPU, both tiles (hpc.cluster.Tiles, issue 32)
    mine = [
        ln
        for ln in script.read_text().splitlines()
        if ln != "export ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE"
    ]
    theirs = (ROOT / "jobs/dpo_aurora.pbs").read_text().splitlines()
    changed = [a for a, b in zip(mine, theirs, strict=True) if a != b]
    assert all(
        re.search(r"select=|mpiexec -n|regenerate|node\(s\)|qsub -A", line) for line in changed
    )
    return script


@pytest.mark.mpi
def test_aurora_pbs_script_runs_as_pbs_would(pals_mpiexec, tmp_path):
    script = _aurora_two_ranks(tmp_path)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "module").write_text("#!/bin/sh\nexit 0\n")  # Lmod's `module load frameworks`
    (stubs / "module").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "PALS_"))}
    env.update(pbs_env(tmp_path, workdir=ROOT))
    env.update(
        PATH=f"{pals_mpiexec}:{stubs}:{env['PATH']}",
        HPC_RUN_DIR=str(tmp_path),
        PYTHONPATH=str(ROOT / "src"),
    )
    proc = subprocess.run(
        ["bash", str(script)], cwd=env["HOME"], env=env, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # ddp.init saw PALS, fell back from XPU to the CPU, and 2 ranks trained to the end
    assert "Initialized DDP: rank=0, world_size=2, local_rank=0" in out
    assert "Using device: cpu" in out
    assert re.search(r"done: steps=\d+", out), out
    assert (tmp_path / "outputs/dpo_ddp/final/model.pt").is_file()


@pytest.mark.mpi
def test_qsub_smoke_through_torque_wrapper(slurm_cluster, pals_mpiexec, lmod_frameworks, tmp_path):
    """`qsub` (slurm-wlm-torque's wrapper: sbatch reading the #PBS lines) runs the Aurora
    script on the SLURM test cluster. The job sees no PBS_* variables there.

    The script is a login shell (`#!/bin/bash -l`, as ALCF's examples), which sets PATH
    afresh and defines Lmod's `module`: the real Lmod loads the test's `frameworks`
    module (the job venv and the PALS shim), as on Aurora."""
    # slurm-wlm-torque's qsub, not OpenPBS's where both are installed and /opt/pbs/bin
    # comes first on PATH (that qsub would send the job to the PBS server instead)
    not_pbs = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != PBS_BIN
    )
    qsub = shutil.which("qsub", path=not_pbs)
    require(qsub is not None, "no slurm-wlm-torque qsub on PATH (apt-get install slurm-wlm-torque)")
    assert qsub is not None
    script = _aurora_two_ranks(tmp_path)
    assert script.read_text().startswith("#!/bin/bash -l\n")
    # The wrapper passes the submitting environment; PBS_O_WORKDIR stands for what real
    # qsub records, so the script's `cd $PBS_O_WORKDIR` finds configs/ in the repository.
    env = dict(
        os.environ,
        PATH=f"{pals_mpiexec}:{os.environ['PATH']}",
        HPC_RUN_DIR=str(tmp_path),
        PYTHONPATH=str(ROOT / "src"),
        PBS_O_WORKDIR=str(ROOT),
    )
    proc = subprocess.run(
        [qsub, "-q", "debug", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.strip().splitlines()[-1].split(".")[0]
    state = slurm_cluster.wait(job_id, timeout=180)
    # the wrapper ignores `-o DIR/`: output comes back PBS-style as SCRIPT.oID / SCRIPT.eID
    text = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob(f"*.[oe]{job_id}"))
    assert state == "COMPLETED", text
    assert "world_size=2" in text and re.search(r"done: steps=\d+", text)
    assert (tmp_path / "outputs/dpo_ddp/final/model.pt").is_file()


def test_resume_submits_into_the_same_run_and_continues(slurm_cluster, tmp_path):
    """After a job ends early (here max_steps), `hpc submit --resume RUN_DIR` continues it."""
    runs = tmp_path / "runs"

    def spec_with(max_steps: int) -> Path:
        spec = worker_spec(tmp_path)
        spec["config"]["checkpoint"]["dir"] = "ck"  # relative: under HPC_RUN_DIR
        spec["config"]["training"]["max_steps"] = max_steps
        return write_spec(tmp_path / f"r{max_steps}.yaml", [PY, WORKER, json.dumps(spec)])

    job1, run_dir = submit(str(spec_with(3)), runs=runs)
    assert wait_status(job1, runs) == "COMPLETED", log_of(run_dir)
    job2 = hpc(
        "submit", "--runs-dir", str(runs), "--resume", str(run_dir), str(spec_with(6))
    ).stdout.strip()
    assert wait_status(job2, runs) == "COMPLETED", log_of(run_dir)
    log = log_of(run_dir)
    assert "resuming from" in log and "(step 3)" in log and "done: steps=6" in log
    assert (run_dir / "ck" / "final" / "model.pt").is_file()
    # one run (runs/.index: the job-id index that `hpc status ID` keeps beside the runs)
    assert [p.name for p in sorted(runs.iterdir()) if p.name != ".index"] == [run_dir.name]
