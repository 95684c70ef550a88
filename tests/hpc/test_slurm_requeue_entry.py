"""``hpc.executors.slurm_env``: a SLURM rank's requeue survives the requeue's own SIGTERM.

slurmctld queues the kill of a requeued job's processes before it replies to
``scontrol requeue`` (see the module's docstring), so on a busy node scontrol can die
of slurmd's SIGTERM after the requeue happened; submitit's rank then wrote an "error"
result that ``job.result()`` returned while the job was requeued (CI, loaded).

These tests run the real entry point (``python -m hpc.executors.slurm_env FOLDER``) as
one srun task would, with SLURM's task variables, and an ``scontrol`` on PATH that
does what slurmctld and slurmd do in that race: it records the requeue, then sends
SIGTERM to every process of the "job" (its process group) before it exits 0. Before the
entry point, submitit's own (``python -m submitit.core._submit``) died in this test
with an "error" result: ``died with <Signals.SIGTERM: 15>``. The real path, on the test
SLURM cluster, is ``test_python_api``'s
``test_slurm_checkpointable_requeued``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import submitit
from submitit.core import utils

from hpc.executors.recorded import SlurmExecutor

REPO = Path(__file__).resolve().parents[2]
JOB_ID = "77"

FAKE_SCONTROL = """#!/bin/sh
# scontrol requeue JOB, racing slurmd: the requeue is recorded, then the job's kill
# (SIGTERM to every process of the job: here its process group) arrives before exit
echo "$@" >> "$SCONTROL_LOG"
grep '^SigIgn:' /proc/$$/status >> "$SCONTROL_LOG"
# the rank puts its own SIGTERM handler back once scontrol has started: wait for that
# (a bound against a hang only), so the kill reaches the rank's handler as slurmd's does
n=0
while [ $(( 0x$(sed -n 's/^SigIgn:[[:space:]]*//p' /proc/$PPID/status) & 0x4000 )) -ne 0 ]; do
  n=$((n + 1)); [ "$n" -lt 600 ] || break; sleep 0.05
done
kill -TERM 0
echo "replied $EXIT" >> "$SCONTROL_LOG"
exit "$EXIT"
"""


pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="needs Linux /proc (the fake reads SigIgn)"
)


class SelfPreempting(submitit.helpers.Checkpointable):
    """Sends its own rank the preemption signal; returns only after a requeue."""

    def __init__(self) -> None:
        self.checkpoints = 0

    def __call__(self) -> str:
        if self.checkpoints:
            return "resumed"
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(60)  # the handler ends this process; a bound against a hang
        return "never preempted"

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        self.checkpoints += 1
        return super().checkpoint(*args, **kwargs)


def _run_rank(
    tmp_path: Path, exit_code: int, module: str
) -> tuple[subprocess.CompletedProcess[str], str, utils.JobPaths]:
    folder = tmp_path / "jobs"
    folder.mkdir()
    paths = utils.JobPaths(folder, job_id=JOB_ID, task_id=0)
    delayed = utils.DelayedSubmission(SelfPreempting())
    delayed.set_timeout(timeout_min=60, max_num_timeout=3)
    delayed.dump(paths.submitted_pickle)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(FAKE_SCONTROL)
    scontrol.chmod(0o755)
    log = tmp_path / "scontrol.log"
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SUBMITIT_", "_TEST_CLUSTER_"))  # e.g. in a CI job
    }
    env = {
        **inherited,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        "SCONTROL_LOG": str(log),
        "EXIT": str(exit_code),
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "localhost",
    }
    # its own session: the fake scontrol's "kill -TERM 0" reaches this rank, not pytest
    proc = subprocess.run(
        [sys.executable, "-u", "-m", module, str(folder)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    return proc, log.read_text() if log.exists() else "", paths


def test_requeue_whose_kill_beats_the_reply_leaves_no_result(tmp_path: Path) -> None:
    proc, log, paths = _run_rank(tmp_path, 0, "hpc.executors.slurm_env")
    out = proc.stdout + proc.stderr
    lines = log.splitlines()
    assert lines[0] == f"requeue {JOB_ID}" and lines[2] == "replied 0", (log, out)
    assert int(lines[1].split()[1], 16) & (1 << (signal.SIGTERM - 1)), lines[1]  # ignored
    assert "Bypassing signal SIGTERM" in out  # the rank itself got the job's SIGTERM
    assert f"Requeued job {JOB_ID} (3 remaining timeouts)" in out, out
    assert proc.returncode == 255, out  # submitit's _exit: sys.exit(-1)
    assert not paths.result_pickle.exists(), out  # job.result() waits for the rerun
    again = utils.DelayedSubmission.load(paths.submitted_pickle)
    assert again.function.checkpoints == 1  # the rerun resumes
    assert again.result() == "resumed"


def test_refused_requeue_is_still_an_error_result(tmp_path: Path) -> None:
    proc, log, paths = _run_rank(tmp_path, 1, "hpc.executors.slurm_env")
    assert "replied 1" in log, log
    outcome, trace = utils.pickle_load(paths.result_pickle)
    assert outcome == "error", trace
    assert "returned non-zero exit status 1" in trace and "scontrol" in trace, trace
    assert proc.returncode != 0


def test_install_replaces_submitit_own_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first activated environment wins: the debug one (``SUBMITIT_DEBUG_JOB_ID``)
    keeps its place behind SLURM's, as with submitit's own list."""
    from submitit.core import plugins

    from hpc.executors import slurm_env

    before = [type(e) for e in plugins._get_plugins()[1]]
    mine = slurm_env.SlurmJobEnvironment()
    try:
        slurm_env._install(mine)
        after = plugins._get_plugins()[1]
        assert [e.name() for e in after] == [c.name() for c in before]
        assert after[[c.name() for c in before].index("slurm")] is mine
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
        monkeypatch.setenv("SUBMITIT_DEBUG_JOB_ID", "leaked")
        monkeypatch.delenv("_TEST_CLUSTER_", raising=False)
        assert plugins.get_job_environment() is mine
    finally:
        plugins._get_plugins.cache_clear()
        plugins.get_job_environments.cache_clear()


def test_the_slurm_executor_runs_this_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: f"/usr/bin/{name}")
    ex = SlurmExecutor(tmp_path / "f b", python="python")
    assert ex._submitit_command_str == f"python -u -m hpc.executors.slurm_env '{tmp_path}/f b'"
    text = ex._make_submission_file_text(ex._submitit_command_str, "u")
    assert f"python -u -m hpc.executors.slurm_env '{tmp_path}/f b'" in text
