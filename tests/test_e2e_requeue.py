"""Requeue after a preemption on the real SLURM (issue 30.5): an array task requeues only
itself, and a requeue SLURM refuses falls back to the next segment, submitted with
``sbatch --dependency=afterany`` into the same directory and log.

The cluster is tests/support/slurm.py's (22.05, nodes n1 and n2). The ranks are
``tests/ddp/_train_worker.py`` under ``srun``, each job of 2 ranks on one node; each test
waits on the events it needs (rank pid files, job states), never on the clock.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from ddp import preemption
from ddp import requeue as requeue_module
from tests.ddp import _launch
from tests.support.polling import wait_until
from tests.support.slurm import URGENT

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
WORKER = str(ROOT / "tests/ddp/_train_worker.py")


def _spec(tmp: Path, name: str, **extra) -> dict:
    """8 steps a rank (64 samples, batch 4, 2 ranks), checkpoints in tmp/name/ck."""
    out = tmp / name
    (out / "ready").mkdir(parents=True)
    spec = {
        "config": {
            "training": {"batch_size": 4, "epochs": 1, "shuffle": True, "seed": 3},
            "optim": {"name": "sgd", "lr": 0.1},
            "checkpoint": {"dir": str(out / "ck")},
            "logging": {"every_n_steps": 2, "progress": "plain"},
            "preemption": {"signals": ["SIGUSR1", "SIGTERM"], "requeue": True},
        },
        "n": 64,
        "out": str(out / "final.pt"),
        "wait_signal_step": 3,
        "ready_dir": str(out / "ready"),
        "wait_timeout": 240,
    }
    spec.update(extra)
    (out / "spec.json").write_text(json.dumps(spec))
    return spec


def _script(tmp: Path, directives: list[str], spec_path: str) -> Path:
    """A batch script as `hpc render` writes one (srun, 2 ranks on one node)."""
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --time=00:05:00",
        "#SBATCH --open-mode=append",
        "set -eo pipefail",
        "export OMP_NUM_THREADS=1",
        f"export PYTHONPATH={ROOT / 'src'}:{ROOT}",
        f'srun --kill-on-bad-exit=1 {PY} {WORKER} "$(cat {spec_path})"',
    ]
    path = tmp / "job.sh"
    path.write_text("\n".join(lines) + "\n")
    return path


def _show(cluster, job: str) -> dict[str, str]:
    out = cluster.run("scontrol", "show", "job", "-o", job, check=False).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _drive(cluster, job: str, done, what: str, log) -> None:
    """Wait for ``done()``, releasing ``job`` from the BeginTime a requeue gives it
    (~2 min on this cluster) whenever it is PENDING."""

    def check() -> bool:
        if _show(cluster, job).get("JobState") == "PENDING":
            cluster.release(job)
        return bool(done())

    wait_until(check, 200, what, log=log)


@pytest.mark.slurm
def test_array_task_requeues_only_itself(slurm_cluster, tmp_path):
    """A 2-task array, both tasks mid-epoch; the task holding the array's own job id (the
    one whose ``scontrol requeue $SLURM_JOB_ID`` requeued the whole array, Lightning
    #15022) is preempted: it alone is requeued and resumes; the other task's ranks run on
    in the same processes, never restarted, and it completes."""
    hold = tmp_path / "go"
    for t in (0, 1):
        _spec(tmp_path, f"t{t}", hold_file=str(hold))
    script = _script(
        tmp_path,
        ["--array=0-1", "--requeue", "--job-name=arr"],
        f"{tmp_path}/t${{SLURM_ARRAY_TASK_ID}}/spec.json",
    )
    array = slurm_cluster.submit(script, sbatch_args=[f"--output={tmp_path}/%A_%a.out"])
    logs = lambda: "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("*.out"))  # noqa: E731
    ready = [tmp_path / f"t{t}" / "ready" for t in (0, 1)]
    wait_until(
        lambda: all(len(list(r.glob("*.pid"))) == 2 for r in ready),
        120,
        "both tasks' ranks at step 3",
        log=logs,
    )
    ids = {
        int(f["ArrayTaskId"]): f["JobId"]
        for f in (_show(slurm_cluster, f"{array}_{t}") for t in (0, 1))
    }
    (victim,) = [t for t, jid in ids.items() if jid == array]  # SLURM gives one task the array's id
    other = 1 - victim
    pids = [int(p.read_text()) for p in ready[other].glob("*.pid")]

    slurm_cluster.run("scancel", "--signal=USR1", f"{array}_{victim}")
    wait_until(
        lambda: _show(slurm_cluster, f"{array}_{victim}").get("Restarts") == "1",
        90,
        "the preempted task requeued",
        log=logs,
    )
    mine = _show(slurm_cluster, f"{array}_{other}")
    assert (mine.get("JobState"), mine.get("Restarts")) == ("RUNNING", "0"), (mine, logs())
    assert all(_alive(p) for p in pids), f"task {other}'s ranks were killed\n{logs()}"

    hold.touch()  # the other task goes on from step 3
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    _drive(
        slurm_cluster,
        f"{array}_{victim}",
        lambda: all(_show(slurm_cluster, f"{array}_{t}").get("JobState") in final for t in (0, 1)),
        "both tasks ended",
        logs,
    )
    for t in (0, 1):
        f = _show(slurm_cluster, f"{array}_{t}")
        assert f["JobState"] == "COMPLETED", (t, f, logs())
        assert f["Restarts"] == ("1" if t == victim else "0"), (t, f)
    victim_log = (tmp_path / f"{array}_{victim}.out").read_text(errors="replace")
    other_log = (tmp_path / f"{array}_{other}.out").read_text(errors="replace")
    assert f"requeued SLURM job {array}_{victim} (scontrol requeue)" in victim_log, victim_log
    assert "resuming from" in victim_log
    assert "resuming from" not in other_log and "requeued SLURM job" not in other_log, other_log
    for t in (0, 1):
        assert (tmp_path / f"t{t}" / "final.pt").is_file()


@pytest.mark.slurm
def test_refused_requeue_submits_the_next_segment(slurm_cluster, tmp_path):
    """A real preemption under ``PreemptMode=CANCEL`` of a job SLURM will not requeue
    (``--no-requeue``: "Requested operation is presently disabled"): a job of a higher
    tier needs the node, SLURM cancels ours (SIGTERM, SIGKILL after KillWait) and it ends
    PREEMPTED for good. Rank 0 saves, then submits the job's own script again with
    ``--dependency=afterany:JOB``; the next segment appends to the same log, resumes
    from the checkpoint and ends with the weights of an uninterrupted run."""
    _spec(tmp_path, "run")
    script = _script(tmp_path, ["--no-requeue", "--job-name=seg"], f"{tmp_path}/run/spec.json")
    out = tmp_path / "seg.out"
    job = slurm_cluster.submit(script, sbatch_args=[f"--output={out}"])
    log = lambda: out.read_text(errors="replace") if out.is_file() else ""  # noqa: E731
    ready = tmp_path / "run" / "ready"
    wait_until(lambda: len(list(ready.glob("*.pid"))) == 2, 120, "ranks at step 3", log=log)
    script.unlink()  # the next segment runs the script SLURM stored, not the file
    node = _show(slurm_cluster, job)["NodeList"]
    urgent = slurm_cluster.run(  # the whole node, whatever its CPU count: ours must go
        "sbatch",
        "--parsable",
        f"--partition={URGENT}",
        f"--nodelist={node}",
        "--exclusive",
        f"--output={tmp_path}/urgent.out",
        "--wrap=true",
    ).stdout.strip()
    found: list[str] = []

    def submitted() -> bool:
        m = re.search(r"submitted the next segment of SLURM job (\d+) as job (\d+)", log())
        if m:
            found[:] = [m.group(1), m.group(2)]
        return bool(m)

    wait_until(submitted, 120, "the fallback submission", log=log)
    assert found[0] == job
    nxt = found[1]
    assert f"scontrol requeue {job} failed" in log() and "presently disabled" in log(), log()
    assert (
        _show(slurm_cluster, nxt).get("Dependency", "").startswith(f"afterany:{job}")
        or _show(slurm_cluster, nxt).get("JobState") != "PENDING"
    )
    state = slurm_cluster.wait(nxt, timeout=200)
    assert state == "COMPLETED", log()
    first = _show(slurm_cluster, job)
    assert (first["JobState"], first["Restarts"]) == ("PREEMPTED", "0"), first  # gone for good
    assert slurm_cluster.state(urgent) == "COMPLETED"
    assert "DUE TO PREEMPTION" in log()
    text = log()
    assert text.index("submitted the next segment") < text.index("resuming from"), text
    resumed = torch.load(tmp_path / "run" / "final.pt", weights_only=False)["state"]

    ref = _spec(tmp_path, "ref")
    for key in ("wait_signal_step", "ready_dir"):
        ref.pop(key)
    results = _launch.run([WORKER, json.dumps(ref)], world=2, timeout=120)
    assert [r[0] for r in results] == [0, 0], results
    reference = torch.load(tmp_path / "ref" / "final.pt", weights_only=False)["state"]
    for k in reference:
        assert torch.equal(resumed[k], reference[k]), k


# ------------------------------------------------------------------ no cluster needed


def test_array_task_id_is_task_qualified():
    env = {"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "1"}
    assert preemption.slurm_job_id(env) == "40_1"
    assert preemption.slurm_job_id({"SLURM_JOB_ID": "41"}) == "41"
    assert preemption.slurm_job_id({}) is None


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_both_failures_are_one_error_line(tmp_path, monkeypatch, caplog):
    """scontrol refuses and sbatch fails too: one error line naming both failures (the
    fake clients are the failure injection: a real controller that refuses both at once
    is not reachable here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    _fake(
        bin_dir,
        "scontrol",
        f"""echo "$@" >> {calls}
case "$1" in
  requeue) echo "scontrol: error: Requested operation is presently disabled" >&2; exit 1;;
  show) echo "JobId=7 JobName=seg WorkDir={tmp_path} StdOut={tmp_path}/seg.out TimeLimit=00:05:00"; exit 0;;
  write) echo '#!/bin/sh' > "$4"; exit 0;;
esac
exit 2
""",
    )
    _fake(
        bin_dir,
        "sbatch",
        f"""echo sbatch "$@" >> {calls}
echo "sbatch: error: Batch job submission failed: Job dependency problem" >&2; exit 1
""",
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    env = {**os.environ, "SLURM_JOB_ID": "7", "RANK": "0", "MASTER_PORT": "1234"}
    caplog.set_level(logging.WARNING, logger="ddp")
    assert preemption.requeue(True, env) is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, caplog.text
    assert "presently disabled" in errors[0] and "Job dependency problem" in errors[0], errors
    sbatch = [ln for ln in calls.read_text().splitlines() if ln.startswith("sbatch")]
    assert sbatch and "--dependency=afterany:7" in sbatch[0], sbatch
    assert f"--chdir={tmp_path}" in sbatch[0] and "--time=00:05:00" in sbatch[0], sbatch


def test_the_next_segment_gets_no_per_rank_variables(tmp_path, monkeypatch):
    """The fallback's sbatch does not pass this rank's RANK, MASTER_PORT or SLURM_* on to
    the next segment's ranks (they would all claim rank 0 of the old job); SLURM_CONF
    stays. An array task submits only itself."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(
        bin_dir,
        "scontrol",
        """case "$1" in
  show) echo "JobId=9 ArrayJobId=8 ArrayTaskId=1 JobName=arr Account=(null)"; exit 0;;
  write) echo '#!/bin/sh' > "$4"; exit 0;;
esac
exit 1
""",
    )
    _fake(bin_dir, "sbatch", f'env > {tmp_path}/env; echo "$@" > {tmp_path}/args; echo 12;\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    env = {
        "PATH": os.environ["PATH"],
        "SLURM_CONF": "/x/slurm.conf",
        "SLURM_JOB_ID": "9",
        "SLURM_PROCID": "0",
        "RANK": "0",
        "MASTER_PORT": "1234",
        "KEEP": "1",
    }
    assert preemption.submit_next_segment("8_1", env) == "12"
    seen = dict(ln.split("=", 1) for ln in (tmp_path / "env").read_text().splitlines() if "=" in ln)
    assert seen["SLURM_CONF"] == "/x/slurm.conf" and seen["KEEP"] == "1"
    assert not {"SLURM_JOB_ID", "SLURM_PROCID", "RANK", "MASTER_PORT"} & set(seen), seen
    args = (tmp_path / "args").read_text().split()
    assert "--array=1" in args and "--dependency=afterany:8_1" in args, args
    assert not any(a.startswith("--account") for a in args), args  # (null): not passed


def test_a_requeue_without_answer_submits_no_second_segment(tmp_path, monkeypatch, caplog):
    """scontrol does not answer in time: the controller may still requeue the job, so no
    second segment is submitted (both would run); one error line says what to check."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    _fake(bin_dir, "scontrol", f'echo "$@" >> {calls}; exec sleep 30')
    _fake(bin_dir, "sbatch", f"echo sbatch >> {calls}; echo 99")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(requeue_module, "CLIENT_TIMEOUT_S", 0.5)  # where _client reads it
    caplog.set_level(logging.WARNING, logger="ddp")
    assert preemption.requeue(True, {**os.environ, "SLURM_JOB_ID": "7"}) is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no answer within 0.5 s" in errors[0], caplog.text
    assert "sbatch" not in calls.read_text()
