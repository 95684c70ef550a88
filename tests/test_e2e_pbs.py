"""End to end on a real OpenPBS server: ``hpc submit``/``status``/``cancel``, plain ``qsub``
of a checked-in script, walltime kills, job arrays, ``-r y`` + ``qrerun`` and a preempted
training run that resumes bitwise in the next run of the same job.

The server is OpenPBS 23.06 from ../shared/pbs (tests/support/openpbs.py starts it; one
host with 4 vnodes, so ``select=2`` jobs get two vnodes of one machine). What it cannot
show: PALS ``mpiexec`` (the Aurora and Polaris launch lines run under the PALS shim,
tests/support/pals, put on the job's PATH by the test's ``frameworks`` module) and
several real hosts. Jobs are submitted from a virtual environment with this checkout
(``pbs_job_venv``), as a user would, so ``hpc submit`` records it for the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.fakeconda import make_conda, make_env
from tests.support.openpbs import FINAL, OpenPBS, wait_final
from tests.support.parts import require_exe
from tests.support.polling import wait_until

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests/ddp/_train_worker.py")

pytestmark = pytest.mark.pbs

# Each rank writes what it saw; `import ddp` proves the job's Python has this checkout.
PROBE = """\
import json, os, sys
import ddp
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PBS_JOBID", "PALS_RANKID", "PBS_ARRAY_INDEX",
        "PALS_SHIM_CPU_BIND", "VIRTUAL_ENV")
out = {k: os.environ.get(k) for k in keys}
out.update(prefix=sys.prefix, ddp=ddp.__file__)
name = f"rank-{os.environ.get('PBS_ARRAY_INDEX', 'x')}-{os.environ['RANK']}.json"
with open(os.path.join(os.environ["HPC_RUN_DIR"], name), "w") as fh:
    json.dump(out, fh)
"""


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


class Hpc:
    """The ``hpc`` CLI run from the job venv, as a user with that venv runs it."""

    def __init__(self, venv: Path, runs: Path, extra_env: dict[str, str] | None = None) -> None:
        self.python = str(venv / "bin" / "python")
        self.runs = runs
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
        self.env = {**env, "OMP_NUM_THREADS": "1", **(extra_env or {})}
        self.submitted: list[str] = []

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.python, "-m", "hpc", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check:
            assert proc.returncode == 0, (
                f"hpc {args}: {proc.returncode}\n{proc.stdout}{proc.stderr}"
            )
        return proc

    def submit(self, *args: str) -> tuple[str, Path]:
        """``hpc submit``: the job id it prints and the run directory it made."""
        before = set(self.runs.iterdir()) if self.runs.exists() else set()
        job_id = self("submit", "--runs-dir", str(self.runs), *args).stdout.strip()
        self.submitted.append(job_id)
        (run_dir,) = set(self.runs.iterdir()) - before
        return job_id, run_dir

    def status(self, run_dir: Path) -> str:
        # the job's line (a sweep adds a line per task after it)
        return (
            self("status", str(run_dir), "--runs-dir", str(self.runs))
            .stdout.split("\n")[0]
            .split()[-1]
        )

    def ended(self, run_dir: Path) -> str | None:
        """The job's final state once it has one, else None."""
        state = self.status(run_dir)
        return state if state in FINAL else None

    def wait(self, run_dir: Path, timeout: float = 120) -> str:
        """Until the job's state is final; a timeout quotes its log."""
        return wait_final(
            lambda: self.status(run_dir),
            timeout,
            f"job of {run_dir.name}",
            log=lambda: log_of(run_dir),
        )

    def wait_for(self, run_dir: Path, check: Any, what: str, timeout: float = 120) -> None:
        """Until ``check()``; ends at once when the job ends first, quoting its log."""
        wait_until(
            check, timeout, what, ended=lambda: self.ended(run_dir), log=lambda: log_of(run_dir)
        )


@pytest.fixture
def hpc(openpbs: OpenPBS, pbs_job_venv: Path, tmp_path: Path) -> Any:
    client = Hpc(pbs_job_venv, tmp_path / "runs")
    yield client
    openpbs.delete_all(client.submitted)


def log_of(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("*.OU")))


def ranks(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank-*.json"))]


# --- hpc submit with the ALCF profiles and the generic one ----------------------------

POLARIS_OVERRIDE = """\
# Polaris gets its Python from `module use /soft/modulefiles; module load conda;
# conda activate`. No conda exists on the test machine, so this override (the
# documented way a site or user changes a profile) replaces those three lines with the
# test's `frameworks` module; every other Polaris fact (directives, queues, PALS flags,
# NCCL variables) is the built-in profile's.
module_use: []
modules: [frameworks]
setup: []
"""


@pytest.mark.parametrize(
    ("cluster", "nodes", "ppn"),
    [
        ("aurora", 1, 2),
        ("aurora", 2, 1),
        ("polaris", 1, 2),
        ("polaris", 2, 1),
    ],
)
def test_hpc_submit_alcf_profile_runs_to_completed(
    hpc: Hpc,
    lmod_frameworks: Path,
    probe: Path,
    tmp_path: Path,
    cluster: str,
    nodes: int,
    ppn: int,
) -> None:
    if cluster == "polaris":
        override = tmp_path / "profiles"
        override.mkdir()
        (override / "polaris.yaml").write_text(POLARIS_OVERRIDE)
        hpc.env["HPC_DDP_CLUSTERS"] = str(override)
    job_id, run_dir = hpc.submit(
        "--cluster",
        cluster,
        "--nodes",
        str(nodes),
        "--ppn",
        str(ppn),
        "--queue",
        "debug",
        "--account",
        "testproj",
        "--walltime",
        "00:05:00",
        "--",
        "python",
        str(probe),
    )
    assert job_id.split(".")[0].isdigit(), job_id
    script = next(run_dir.glob("job*.pbs")).read_text()
    assert f"#PBS -l select={nodes}:system={cluster}" in script
    assert "module load frameworks" in script
    assert hpc.wait(run_dir) == "COMPLETED", log_of(run_dir)
    seen = ranks(run_dir)
    assert sorted(int(r["RANK"]) for r in seen) == list(range(nodes * ppn)), log_of(run_dir)
    assert {r["WORLD_SIZE"] for r in seen} == {str(nodes * ppn)}
    assert {r["PBS_JOBID"] for r in seen} == {job_id}
    assert all(r["PALS_RANKID"] == r["RANK"] for r in seen)  # launched by (the PALS shim's) mpiexec
    assert all(Path(r["ddp"]).is_relative_to(ROOT) for r in seen)


def test_generic_pbs_job_runs_with_the_submitting_venv(hpc: Hpc, probe: Path) -> None:
    """The issue's failure: on PBS a Python job got the login shell's `python`."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    job_id, run_dir = hpc.submit(
        "--cluster", "pbs", "--nodes", "2", "--walltime", "00:05:00", "--", "python", str(probe)
    )
    venv = Path(hpc.python).parent.parent
    script = next(run_dir.glob("job*.pbs")).read_text()
    assert f"source {venv}/bin/activate" in script
    assert yaml.safe_load(next(run_dir.glob("spec*.yaml")).read_text())["python"] == {
        "venv": str(venv)
    }
    assert hpc.wait(run_dir) == "COMPLETED", log_of(run_dir)
    seen = ranks(run_dir)
    assert len(seen) == 2, log_of(run_dir)
    assert {r["prefix"] for r in seen} == {str(venv)}


def test_a_conda_environment_activates_in_a_pbs_job(hpc: Hpc, tmp_path: Path) -> None:
    """Issue 24: a conda environment was activated with a bare ``conda activate`` and the
    job exited 1 with "Run 'conda init'" (a batch shell ran no ``conda init``); it is now
    activated through its own conda's shell hook. The conda has the real layout and
    behaviour (tests/support/fakeconda.py: no real conda can be installed here)."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    env = make_env(make_conda(tmp_path / "miniconda3"))
    spec = tmp_path / "conda.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "conda",
                "cluster": "pbs",
                "wrap": "never",
                "walltime": "00:05:00",
                "python": {"conda": str(env)},
                "command": ["bash", "-c", 'echo "prefix=$CONDA_PREFIX"; hpc-probe'],
            }
        )
    )
    _, run_dir = hpc.submit(str(spec))
    assert hpc.wait(run_dir) == "COMPLETED", log_of(run_dir)
    log = log_of(run_dir)
    assert f"prefix={env}\n" in log and f"probe={env}/bin/hpc-probe activated=torch" in log, log


# --- cancel, walltime, arrays ----------------------------------------------------------


def test_cancel_of_a_queued_job(hpc: Hpc, openpbs: OpenPBS) -> None:
    # 5 scattered chunks never fit on the 4 vnodes: the job stays queued
    job_id, run_dir = hpc.submit("--cluster", "pbs", "--nodes", "5", "--", "sleep", "1")
    openpbs.wait_letter(job_id, "Q", log=lambda: log_of(run_dir))
    assert hpc.status(run_dir) == "PENDING"
    hpc("cancel", str(run_dir), "--runs-dir", str(hpc.runs))
    assert hpc.wait(run_dir, 60) == "CANCELLED"
    assert "Exit_status" not in openpbs.attrs(job_id)


@pytest.mark.parametrize("trap", [False, True], ids=["plain", "trapping-TERM"])
def test_cancel_of_a_running_job(hpc: Hpc, openpbs: OpenPBS, tmp_path: Path, trap: bool) -> None:
    """qdel of a running job: substate 91 with Exit_status 271, or 0 when the job's shell
    exits by itself on TERM; both read CANCELLED (they read COMPLETED/FAILED before)."""
    started = tmp_path / "started"
    body = f"touch {started}; " + (
        "trap 'exit 0' TERM; sleep 300 & wait" if trap else "exec sleep 300"
    )
    spec = tmp_path / "sleep.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "sleeper",
                "cluster": "pbs",
                "wrap": "never",
                "launcher": "mpiexec",
                "walltime": "00:05:00",
                "command": ["bash", "-c", body],
            }
        )
    )
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    job_id, run_dir = hpc.submit(str(spec))
    hpc.wait_for(run_dir, started.exists, "job started", 60)
    openpbs.wait_letter(job_id, "R", log=lambda: log_of(run_dir))
    assert hpc.status(run_dir) == "RUNNING"
    hpc("cancel", str(run_dir), "--runs-dir", str(hpc.runs))
    assert hpc.wait(run_dir, 90) == "CANCELLED"
    assert str(openpbs.attrs(job_id)["substate"]) == "91"


def test_walltime_kill_reads_timeout(hpc: Hpc, openpbs: OpenPBS) -> None:
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    job_id, run_dir = hpc.submit(
        "--cluster", "pbs", "--walltime", "00:00:08", "--wrap", "never", "--", "sleep", "300"
    )
    assert hpc.wait(run_dir, 120) == "TIMEOUT", log_of(run_dir)
    attrs = openpbs.attrs(job_id)
    assert (str(attrs["substate"]), int(attrs["Exit_status"])) == ("93", -29)
    assert "walltime" in log_of(run_dir)


def test_job_array(hpc: Hpc, openpbs: OpenPBS, probe: Path, tmp_path: Path) -> None:
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    spec = tmp_path / "array.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "arr",
                "cluster": "pbs",
                "walltime": "00:05:00",
                "directives": ["-J 0-2"],
                "command": ["python", str(probe)],
            }
        )
    )
    job_id, run_dir = hpc.submit(str(spec))
    assert job_id.split(".")[0].endswith("[]"), job_id
    assert hpc.wait(run_dir) == "COMPLETED", log_of(run_dir)
    assert sorted(r["PBS_ARRAY_INDEX"] for r in ranks(run_dir)) == ["0", "1", "2"]
    subjobs = json.loads(openpbs.run("qstat", "-x", "-t", "-f", "-F", "json", job_id).stdout)[
        "Jobs"
    ]
    assert sorted(j["substate"] for j in subjobs.values()) == [92] * 4  # parent + 3 subjobs


SWEEP_PROBE = """\
import json, os, sys
with open(os.path.join(os.environ["HPC_RUN_DIR"], "args.json"), "w") as fh:
    json.dump({"argv": sys.argv[1:], "label": os.environ.get("HPC_SWEEP_LABEL"),
               "index": os.environ.get("PBS_ARRAY_INDEX")}, fh)
print("task", os.environ.get("HPC_SWEEP_LABEL"))
"""


def test_sweep_is_one_pbs_array_with_a_folder_and_a_status_line_per_task(
    hpc: Hpc,
    openpbs: OpenPBS,
    tmp_path: Path,
) -> None:
    """``--sweep`` on the real server: ``-J 0-1%1`` (max_run_subjobs), each subjob reads its
    overrides from sweep.json by PBS_ARRAY_INDEX, and ``hpc status``/``hpc logs`` see each task."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    probe = tmp_path / "sweep_probe.py"
    probe.write_text(SWEEP_PROBE)
    job_id, run_dir = hpc.submit(
        "--cluster",
        "pbs",
        "--walltime",
        "00:05:00",
        "--name",
        "sw",
        "--sweep",
        "optim.lr=0.1,0.01",
        "--max-parallel",
        "1",
        "--",
        "python",
        str(probe),
    )
    assert job_id.split(".")[0].endswith("[]"), job_id
    assert "#PBS -J 0-1%1\n" in next(run_dir.glob("job*.pbs")).read_text()
    assert str(openpbs.attrs(job_id).get("max_run_subjobs")) == "1"
    assert hpc.wait(run_dir) == "COMPLETED", log_of(run_dir)
    lines = hpc("status", str(run_dir), "--runs-dir", str(hpc.runs)).stdout.splitlines()
    seq, rest = job_id.split("[]")
    assert [ln.split()[:2] for ln in lines[1:]] == [
        [f"{seq}[0]{rest}", "COMPLETED"],
        [f"{seq}[1]{rest}", "COMPLETED"],
    ], lines
    for task, lr in (("000-lr-0.1", "0.1"), ("001-lr-0.01", "0.01")):
        seen = json.loads((run_dir / task / "args.json").read_text())
        assert seen["argv"] == ["--set", f"optim.lr={lr}"] and seen["label"] == f"optim.lr={lr}"
    log = hpc("logs", f"{seq}[1]{rest}", "--runs-dir", str(hpc.runs)).stdout
    assert "task optim.lr=0.01" in log


# --- -r y, qrerun and preemption -------------------------------------------------------


def test_rerunnable_job_is_rerun_by_qrerun(hpc: Hpc, openpbs: OpenPBS, tmp_path: Path) -> None:
    runs_file = tmp_path / "runs.txt"
    body = (
        f'echo "$PBS_JOBID" >> {runs_file}; '
        f'if [ "$(wc -l < {runs_file})" -lt 2 ]; then exec sleep 300; fi'
    )
    spec = tmp_path / "rerun.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "rerun",
                "cluster": "pbs",
                "wrap": "never",
                "walltime": "00:05:00",
                "requeue": True,
                "command": ["bash", "-c", body],
            }
        )
    )
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    job_id, run_dir = hpc.submit(str(spec))
    assert "#PBS -r y" in next(run_dir.glob("job*.pbs")).read_text()
    hpc.wait_for(run_dir, runs_file.exists, "first run started", 60)
    openpbs.wait_letter(job_id, "R", log=lambda: log_of(run_dir))
    openpbs.run("qrerun", job_id)
    assert hpc.wait(run_dir) == "COMPLETED", log_of(run_dir)
    assert runs_file.read_text().split() == [job_id, job_id]
    assert int(openpbs.attrs(job_id)["run_count"]) == 2


def _worker_spec(tmp: Path, **extra: Any) -> dict[str, Any]:
    """tests/ddp/_train_worker.py: a small deterministic Trainer run, 8 steps a rank."""
    spec: dict[str, Any] = {
        "config": {
            "training": {"batch_size": 4, "epochs": 1, "shuffle": True, "seed": 3},
            "optim": {"name": "sgd", "lr": 0.1},
            "checkpoint": {"dir": str(tmp / "ck")},
            "logging": {"every_n_steps": 2, "progress": "plain"},
            "preemption": {"signals": ["SIGTERM"], "requeue": False},
        },
        "n": 64,
        "out": str(tmp / "final.pt"),
    }
    spec.update(extra)
    return spec


def test_preempted_job_checkpoints_and_resumes_bitwise_in_its_rerun(
    hpc: Hpc,
    openpbs: OpenPBS,
    tmp_path: Path,
) -> None:
    """qrerun (PBS's preemption by requeue) sends SIGTERM: the trainer saves at the step
    boundary and exits; PBS runs the same job again, which resumes from that checkpoint
    and ends with the weights of a run never interrupted."""
    import torch

    from tests.ddp import _launch

    require_exe("mpiexec.hydra", "mpiexec.mpich")
    ready = tmp_path / "ready"
    ready.mkdir()
    spec = _worker_spec(tmp_path, wait_signal_step=3, ready_dir=str(ready), wait_timeout=120)
    job_file = tmp_path / "pre.yaml"
    job_file.write_text(
        yaml.safe_dump(
            {
                "name": "pre",
                "cluster": "pbs",
                "nodes": 1,
                "ppn": 2,
                "walltime": "00:05:00",
                "wrap": "never",
                "requeue": True,
                "env": {"OMP_NUM_THREADS": "1"},
                "command": ["python", WORKER, json.dumps(spec)],
            }
        )
    )
    job_id, run_dir = hpc.submit(str(job_file))
    hpc.wait_for(run_dir, lambda: len(list(ready.glob("*.pid"))) == 2, "both ranks at step 3")
    openpbs.run("qrerun", job_id)
    assert hpc.wait(run_dir, 180) == "COMPLETED", log_of(run_dir)
    assert int(openpbs.attrs(job_id)["run_count"]) == 2
    log = log_of(run_dir)
    assert "resuming from" in log, log
    resumed = torch.load(tmp_path / "final.pt", weights_only=False)["state"]

    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    results = _launch.run([WORKER, json.dumps(_worker_spec(ref_dir))], world=2, timeout=120)
    assert [r[0] for r in results] == [0, 0], results
    reference = torch.load(ref_dir / "final.pt", weights_only=False)["state"]
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key


# --- plain qsub of the checked-in Aurora script, and every profile's directives --------


@pytest.mark.slow
@pytest.mark.timeout(600)  # 24 ranks on 2 cores: about 2 minutes
def test_plain_qsub_of_checked_in_aurora_script(
    openpbs: OpenPBS,
    lmod_frameworks: Path,
    tmp_path: Path,
) -> None:
    """`qsub -A PROJECT jobs/dpo_aurora.pbs` as the README says, the script unchanged:
    `module load frameworks` is Lmod loading the test's modulefile, `mpiexec` the PALS
    shim (2 x 12 ranks on this one machine), DPO's shipped config trains to the end.

    The config is the shipped one with one epoch of its three: 24 ranks on 2 cores took
    240 s and 470 CPU-seconds for three (the suite's largest), and the later epochs
    run the same code."""
    work = tmp_path / "project"
    for rel in ("jobs/dpo_aurora.pbs", "configs/dpo.yaml"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes((ROOT / rel).read_bytes())
    config = yaml.safe_load((work / "configs/dpo.yaml").read_text())
    config["training"]["epochs"] = 1
    (work / "configs/dpo.yaml").write_text(yaml.safe_dump(config))
    (work / "logs").mkdir()
    env = dict(os.environ, PATH=f"{openpbs.bin}{os.pathsep}{os.environ['PATH']}")
    job_id = openpbs.run(
        "qsub", "-A", "testproj", "jobs/dpo_aurora.pbs", cwd=work, env=env
    ).stdout.strip()
    try:
        attrs = openpbs.wait_letter(job_id, "F", timeout=540)
    finally:
        openpbs.delete_all([job_id])
    out = "\n".join(p.read_text(errors="replace") for p in (work / "logs").glob("*"))
    assert (str(attrs["substate"]), attrs.get("Exit_status")) == ("92", 0), out
    assert "world_size=24" in out, out
    assert (work / "outputs/dpo_ddp/final/model.pt").is_file(), out
    # split_logs: stdout and stderr apart, as seed 001's job wrote them
    assert sorted(p.suffix for p in (work / "logs").iterdir()) == [".ER", ".OU"], out


@pytest.mark.parametrize("cluster", ["aurora", "polaris", "pbs"])
def test_every_pbs_profile_renders_directives_the_server_accepts(
    openpbs: OpenPBS,
    tmp_path: Path,
    cluster: str,
) -> None:
    """Each built-in PBS profile, for every queue it names (and with `-r y`, `-k doe` and
    `-J`): the real `qsub -h` accepts the rendered script; qdel removes the held job."""
    from hpc import profiles as clusters

    profile = clusters.load(cluster, environ={})
    assert profile.scheduler == "pbs"
    cases: list[dict[str, Any]] = [
        {"queue": name, "nodes": queue.min_nodes, "walltime": "00:10:00"}
        for name, queue in profile.queues.items()
    ] or [{"nodes": 2}]
    cases.append({**cases[0], "requeue": True, "directives": ["-J 0-1"]})
    for name in profile.queues:  # the server has ALCF's common queues; add by-request ones
        if openpbs.run("qstat", "-Q", name, check=False).returncode != 0:
            openpbs.run(
                "qmgr", "-c", f"create queue {name} queue_type=execution,enabled=true,started=true"
            )
    for n, case in enumerate(cases):
        spec = tmp_path / f"{cluster}-{n}.yaml"
        spec.write_text(
            yaml.safe_dump(
                {
                    "name": f"hold-{cluster}",
                    "cluster": cluster,
                    "account": "testproj",
                    "command": ["python", "-c", "pass"],
                    **case,
                }
            )
        )
        script = tmp_path / f"{cluster}-{n}.pbs"
        subprocess.run(
            [sys.executable, "-m", "hpc", "render", str(spec), "-o", str(script)],
            check=True,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        proc = openpbs.run("qsub", "-h", str(script), check=False)
        assert proc.returncode == 0, f"{cluster} {case}: {proc.stderr}\n{script.read_text()}"
        job_id = proc.stdout.strip()
        try:
            assert openpbs.attrs(job_id)["job_state"] == "H", case
        finally:
            openpbs.run("qdel", job_id)
        assert openpbs.wait_letter(job_id, "F")["substate"] == 91


def test_wrapper_says_where_to_get_openpbs_when_shared_is_absent(tmp_path: Path) -> None:
    """A checkout without ../shared/pbs: one message naming the folder, exit 3 (no traceback,
    nothing started); the fixture turns that into a skip (a failure under CI=true)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/openpbs.sh"), "start"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OPENPBS_SHARED=str(tmp_path)),
        check=False,
    )
    assert proc.returncode == 3, proc.stderr
    assert f"no {tmp_path}/setup-openpbs.sh" in proc.stderr
    assert "<checkout>/../shared/pbs" in proc.stderr and proc.stdout == ""
