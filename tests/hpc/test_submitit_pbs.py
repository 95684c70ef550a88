"""The submitit PBS plugin: qstat parsing on real-format samples, and whole jobs (submit,
two PALS ranks, cancel, requeue, arrays, an old server without JSON, a refusal) on the
real OpenPBS server (tests/support/openpbs.py). The real server's own qstat answers for
every terminal state are checked in test_pbs_status.py."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import submitit

import hpc
from hpc.cli import main as cli_main
from hpc.errors import SchedulerError, UserError
from hpc.executors import pbs as sp
from hpc.executors import pbs_env as pbs_env_mod
from hpc.schedulers import pbs as client
from tests.support.openpbs import OpenPBS
from tests.support.pals import pbs_env
from tests.support.parts import require_exe
from tests.support.polling import wait_until

DATA = Path(__file__).parent / "data"
SAMPLES = DATA  # hand-written qstat -f / plain qstat text samples (see data/openpbs/README.md)
AURORA_ID = "1234567.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"
# Job functions travel by value: the compute side need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def wait_done(job: Any, timeout: float = 300) -> None:
    """Until ``job`` is done; the bound is against a hang only (a loaded 2-core machine
    is several times slower than a quiet one), the same for every job."""
    wait_until(lambda: job.done(force_check=True), timeout, f"job {job.job_id} done")


# --- parsing real-format qstat answers ------------------------------------------------


def test_queued_and_running_samples() -> None:
    queued = client.read_qstat_json((DATA / "qstat_queued.json").read_text())
    assert queued[AURORA_ID]["State"] == "PENDING"
    assert queued[AURORA_ID]["comment"].startswith("Not Running")
    running = client.read_qstat_json((DATA / "qstat_running.json").read_bytes())
    assert running[AURORA_ID]["State"] == "RUNNING"
    assert running[AURORA_ID]["exec_host"].startswith("x4102c5s0b0n0/0*208")


@pytest.mark.parametrize(
    ("seq", "state"),
    [
        (4100, "COMPLETED"),  # Exit_status 0
        (4101, "FAILED"),  # Exit_status 1
        (4102, "CANCELLED"),  # 271 = 256 + SIGTERM: qdel of a running job
        (4103, "TIMEOUT"),  # -29: killed at the walltime
        (4104, "CANCELLED"),  # deleted before it ran: no Exit_status, substate 91
    ],
)
def test_finished_jobs_from_history(seq: int, state: str) -> None:
    info = client.read_qstat_json((DATA / "qstat_history.json").read_text())
    assert info[f"{seq}.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov"]["State"] == state


def test_array_subjobs_are_keyed_by_submitit_ids() -> None:
    info = client.read_qstat_json((DATA / "qstat_array.json").read_text())
    parent = "2000100[].aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"
    assert info[parent]["State"] == "RUNNING"  # B: begun
    states = [info[f"{parent}_{i}"]["State"] for i in range(4)]
    assert states == ["COMPLETED", "FAILED", "RUNNING", "PENDING"]
    # the PBS form of a subjob id answers too
    assert info["2000100[1].aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"]["State"] == "FAILED"
    assert client.pbs_query_id(f"{parent}_3") == parent
    assert (
        client.submitit_id("12[3].srv") == "12[].srv_3"
        and client.pbs_id("12[].srv_3") == "12[3].srv"
    )
    assert client.pbs_id("12.srv") == "12.srv"


def test_unescaped_backslashes_of_older_servers_are_tolerated() -> None:
    info = client.read_qstat_json((DATA / "qstat_bad_escapes.json").read_text())
    assert info["881.pbs01"]["State"] == "RUNNING"


def test_text_and_plain_fallback_formats() -> None:
    text = client.read_qstat_text((SAMPLES / "qstat_f.txt").read_text())
    assert text[AURORA_ID]["State"] == "RUNNING"
    assert text[AURORA_ID]["comment"].endswith("(x4102c5s1b0n0:ncpus=208)")  # wrapped line joined
    assert text["1234568.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"]["State"] == "FAILED"
    plain = client.read_qstat_plain((SAMPLES / "qstat.txt").read_text())
    assert client.lookup(plain, AURORA_ID)["State"] == "RUNNING"  # id cut to 16 columns
    assert client.lookup(plain, "1234569.aurora-pbs-0001")["State"] == "PENDING"
    assert client.lookup(plain, "1234571.aurora") is None


def test_lookup_matches_other_forms_of_the_server_name() -> None:
    info = client.read_qstat_json((DATA / "qstat_running.json").read_text())
    assert client.lookup(info, "1234567.aurora-pbs-0001")["State"] == "RUNNING"
    assert client.lookup(info, "1234567")["State"] == "RUNNING"
    assert client.lookup(info, "7654321") is None


def test_query_falls_back_and_reads_unknown_ids(fake_bin: Any) -> None:
    """JSON refused (an old server) -> qstat -x -f text; an id it does not know is done."""
    sample = (SAMPLES / "qstat_f.txt").read_text().replace("'", "'\\''")
    fake_bin(
        "qstat",
        f"""
case "$*" in
  *"-F json"*) echo "qstat: invalid option -- 'F'" >&2; exit 2 ;;
  *-f*) printf '%s' '{sample}'; echo "qstat: Unknown Job Id 99.aurora-pbs-0001" >&2; exit 153 ;;
esac
exit 1""",
    )
    out = client.query([AURORA_ID, "99.aurora-pbs-0001"])
    assert out[AURORA_ID]["State"] == "RUNNING"
    assert out["99.aurora-pbs-0001"]["State"] == client.GONE
    calls = fake_bin.log.read_text().splitlines()
    assert calls[0].startswith("qstat -x -f -F json") and calls[1].startswith("qstat -x -f 1234567")


# --- the compute side ----------------------------------------------------------------


def test_job_environment_reads_pals_and_pbs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = pbs_env(tmp_path, ["x4102c5s0b0n0", "x4102c5s1b0n0"], mpiprocs=1)
    for key, value in {
        **env,
        "PALS_RANKID": "13",
        "PALS_LOCAL_RANKID": "1",
        "PMI_SIZE": "24",
        "PALS_NODEID": "1",
        "SUBMITIT_EXECUTOR": "pbs",
    }.items():
        monkeypatch.setenv(key, value)
    e = pbs_env_mod.PBSJobEnvironment()
    assert (e.global_rank, e.local_rank, e.num_tasks, e.node, e.num_nodes) == (13, 1, 24, 1, 2)
    assert e.hostnames == ["x4102c5s0b0n0", "x4102c5s1b0n0"]
    assert e.job_id == env["PBS_JOBID"] and e.activated()
    monkeypatch.delenv("PALS_NODEID")
    assert e.node == 1  # 13 // (24 / 2 nodes)
    monkeypatch.setenv("PBS_ARRAY_ID", "77[].srv")
    monkeypatch.setenv("PBS_ARRAY_INDEX", "4")
    assert e.job_id == "77[].srv_4"
    monkeypatch.setenv("SUBMITIT_PBS_JOB_ID", "70.srv")  # a requeued job keeps the first id
    assert e.job_id == "70.srv"


def test_requeue_script_drops_the_array_and_keeps_the_id() -> None:
    text = "#!/bin/bash\n# x\n#PBS -N a\n#PBS -J 0-3\n\nset -e\nmpiexec python\n"
    out = pbs_env_mod.requeue_script(text, "12[].srv_2")
    assert "#PBS -J" not in out
    lines = out.splitlines()
    assert (
        lines.index("#PBS -N a")
        < lines.index("export SUBMITIT_PBS_JOB_ID='12[].srv_2'  # requeued by submitit")
        < lines.index("set -e")
    )


def test_parameters_are_checked_like_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in ("PBS_ACCOUNT", "HPC_ACCOUNT"):
        monkeypatch.delenv(var, raising=False)
    ex = sp.PBSExecutor(tmp_path, cluster="aurora")
    with pytest.raises(UserError) as exc:
        ex.update_parameters(nodes=3, queue="debug", account="p")
    assert (
        cli_main(
            [
                "render",
                "--cluster",
                "aurora",
                "--nodes",
                "3",
                "--queue",
                "debug",
                "--account",
                "p",
                "--",
                "python",
                "x.py",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == f"hpc: error: {exc.value}"
    with pytest.raises(UserError, match="did you mean nodes"):
        ex.update_parameters(nodez=2)
    ex.update_parameters(timeout_min=30, tasks_per_node=6, account="p")
    job = ex.resolve()
    assert (job.walltime, job.ppn, job.queue) == (1800, 6, "debug")


# --- whole jobs on the real OpenPBS server ---------------------------------------------


@pytest.fixture
def pbs(openpbs: OpenPBS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The real server's clients first on PATH (the ``openpbs`` fixture), a fresh folder,
    and an ``aurora-here`` profile: Aurora's, minus the high-speed-network host suffix
    (no ``*.hsn.cm.aurora.alcf.anl.gov`` names resolve here)."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "aurora-here.yaml").write_text(
        "extends: aurora\nenv: {DDP_MASTER_ADDR_SUFFIX: ''}\n"
    )
    monkeypatch.setenv("HPC_DDP_CLUSTERS", str(profiles))
    monkeypatch.chdir(tmp_path)
    sp.PBSJob.watcher.clear()
    before = _job_ids(openpbs, history=True)
    yield tmp_path
    openpbs.delete_all(sorted(_job_ids(openpbs, history=True) - before))


def _job_ids(openpbs: OpenPBS, history: bool = False) -> set[str]:
    """Jobs the server knows now (with ``history``, finished ones too), to clean up after."""
    out = openpbs.run("qstat", *(["-x"] if history else []), "-f", "-F", "json", check=False).stdout
    return set((json.loads(out).get("Jobs") or {}) if out.strip() else {})


def add(a: int, b: int) -> int:
    return a + b


def test_submit_gets_the_result(pbs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    ex = hpc.executor(cluster="pbs", walltime="00:05:00", name="adder")  # folder: a run dir
    (run_dir,) = (pbs / "runs").iterdir()
    job = ex.submit(add, 2, 3)
    assert job.job_id.split(".")[0].isdigit(), job.job_id
    wait_done(job)
    assert job.result() == 5
    wait_until(lambda: job.get_info().get("State") == "COMPLETED", 30, "F, substate 92")
    script = job.paths.submission_file.read_text()
    assert "#PBS -N adder\n" in script and "#PBS -l select=1\n" in script
    assert f"#PBS -o {run_dir}/\n" in script
    # -prepend-rank: the merged .OU is rank-labelled (issue 31); each rank's own log as before
    assert (
        f"mpiexec -n 1 -ppn 1 -prepend-rank {sys.executable} -u -m hpc.executors.pbs {run_dir}"
        in script
    )
    assert "INFO" in job.stdout()  # the rank's own log, as srun --output writes on SLURM
    assert (run_dir / f"{job.job_id}.OU").is_file()  # the batch shell's, from #PBS -o
    assert cli_main(["status", str(run_dir)]) == 0  # the run directory names the job
    assert capsys.readouterr().out == f"{job.job_id} COMPLETED\n"


def ranks_and_sum() -> tuple[int, int, float, str]:
    import torch
    import torch.distributed as dist

    import ddp

    ctx = ddp.init(backend="gloo", timeout=60)
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    return ctx.rank, ctx.world_size, float(value.item()), ctx.launcher


def test_two_ranks_through_the_pals_mpiexec(pbs: Path, lmod_frameworks: Path) -> None:
    """Aurora's script as rendered (``module load frameworks`` is real Lmod loading the
    test's modulefile, which also puts the PALS shim on PATH: no PALS exists here)."""
    ex = hpc.executor(
        cluster="aurora-here",
        ppn=2,
        queue="debug",
        account="MyProject",
        walltime="00:10:00",
        folder=pbs / "jobs",
    )
    job = ex.submit(hpc.distributed(ranks_and_sum))
    wait_done(job)
    assert job.results() == [(0, 2, 3.0, "pals"), (1, 2, 3.0, "pals")], job.stderr()
    assert job.task(0).result() == (0, 2, 3.0, "pals")
    script = job.paths.submission_file.read_text()
    for line in (
        "#PBS -l select=1:system=aurora",
        "#PBS -l place=scatter",
        "#PBS -l filesystems=home:flare",
        "#PBS -q debug",
        "#PBS -A MyProject",
        "#PBS -l walltime=00:10:00",
        "export CCL_ATL_TRANSPORT=mpi",
        "module load frameworks",
    ):
        assert line in script
    assert "mpiexec -n 2 --ppn 2 --cpu-bind list:1-16:17-32:" in script  # one rank per GPU


def sleep_long() -> str:
    time.sleep(120)
    return "not cancelled"


def test_cancel(pbs: Path, openpbs: OpenPBS) -> None:
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    ex = hpc.executor(cluster="pbs", folder=pbs / "jobs")
    job = ex.submit(sleep_long)
    wait_until(lambda: job.get_info().get("State") == "RUNNING", 60, "job running")
    wait_until(job.paths.stdout.exists, 60, "rank started")
    job.cancel()
    wait_done(job)
    assert job.state == "CANCELLED"
    assert job.get_info()["substate"] == "91"  # Exit_status 271 or 0: the substate decides
    with pytest.raises(Exception):  # noqa: B017 - submitit raises its own UncompletedJobError
        job.result()


class Resumable(submitit.helpers.Checkpointable):
    """Waits to be interrupted; the checkpoint records it, the requeued run returns."""

    def __init__(self) -> None:
        self.interrupted = 0

    def __call__(self, marker: str) -> tuple[str, int, str]:
        if self.interrupted:
            return "resumed", self.interrupted, os.environ["PBS_JOBID"]
        Path(marker).write_text(os.environ["PBS_JOBID"])
        time.sleep(120)
        return "never interrupted", 0, os.environ["PBS_JOBID"]

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        self.interrupted += 1
        return super().checkpoint(*args, **kwargs)


def first_run_waits(marker: str) -> tuple[str, str]:
    """The first run marks itself and waits to be rerun; a rerun returns at once."""
    if Path(marker).exists():
        return "rerun", os.environ["PBS_JOBID"]
    Path(marker).write_text(os.environ["PBS_JOBID"])
    time.sleep(120)
    return "never rerun", os.environ["PBS_JOBID"]


def test_qrerun_reruns_the_function_under_the_same_id(pbs: Path, openpbs: OpenPBS) -> None:
    """PBS's own preemption by requeue (``qrerun`` of a ``-r y`` job): the job runs again
    under the same PBS id and ``job.result()`` is the second run's.

    Not ``job._interrupt()`` (``qsig -s USR2``): on the real server the signal goes to
    the job's session only, where the login shell PBS starts the script from dies of it
    (PBS then reports the job finished, Exit_status 0), and MPICH hydra's ranks, in
    sessions of their own, never see it. The preemption signal the plugin relies on is
    the ranks' own timer (next test)."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    ex = hpc.executor(cluster="pbs", walltime="00:10:00", requeue=True, folder=pbs / "jobs")
    marker = pbs / "started"
    job = ex.submit(first_run_waits, str(marker))
    assert "#PBS -r y" in job.paths.submission_file.read_text()
    wait_until(marker.exists, 60, "first run started")
    openpbs.wait_letter(job.job_id, "R")
    openpbs.run("qrerun", job.job_id)
    wait_done(job)
    assert job.result() == ("rerun", job.job_id)
    assert int(openpbs.attrs(job.job_id)["run_count"]) == 2


def test_walltime_signal_requeues_before_the_end(pbs: Path) -> None:
    """PBS sends no signal before the walltime: the ranks' own timer does (here 10 s in).

    Every run of the job gets the same timer, the rerun too: it must reach the function
    and return before its own 10 s are up, or it is signalled and requeued again (the
    plugin working as designed). With a 2 s timer a rerun on a loaded 2-core machine
    (mpiexec, Python and torch start-up) missed it and the result said 2 requeues; so
    the timer leaves start-up room, and the count asserted is "at least one"."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    ex = hpc.executor(cluster="pbs", walltime="00:01:00", signal="USR2@50", folder=pbs / "jobs")
    job = ex.submit(hpc.distributed(Resumable()), str(pbs / "started"))
    wait_done(job)
    outcome, interrupted, _ = job.result()
    assert outcome == "resumed" and interrupted >= 1
    assert "SUBMITIT_PBS_DEADLINE=$(( $(date +%s) + 10 ))" in job.paths.submission_file.read_text()


def test_map_array_is_one_pbs_array(pbs: Path) -> None:
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    ex = hpc.executor(cluster="pbs", folder=pbs / "jobs")
    jobs = ex.map_array(add, [1, 2, 3], [10, 20, 30])
    parent = jobs[0].job_id.rsplit("_", 1)[0]
    assert parent.split(".")[0].endswith("[]")
    assert [j.job_id for j in jobs] == [f"{parent}_{i}" for i in range(3)]
    for job in jobs:
        wait_done(job)
    assert [j.result() for j in jobs] == [11, 22, 33]
    assert "#PBS -J 0-2" in jobs[0].paths.submission_file.read_text()
    wait_until(
        lambda: [j.get_info().get("State") for j in jobs] == ["COMPLETED"] * 3,
        30,
        "subjobs ended (substate 92)",
    )


def test_old_server_without_json(pbs: Path, fake_bin: Any, openpbs: OpenPBS) -> None:
    """A server before PBS Pro 19 (or Torque) refuses ``-F json``: the real qstat behind a
    wrapper that refuses it, so the plugin reads real ``qstat -x -f`` text instead."""
    require_exe("mpiexec.hydra", "mpiexec.mpich")
    fake_bin(
        "qstat",
        f"""case " $* " in *" -F "*) echo "qstat: invalid option -- 'F'" >&2; exit 2;; esac
exec {openpbs.bin / "qstat"} "$@"\n""",
    )
    ex = hpc.executor(cluster="pbs", folder=pbs / "jobs")
    job = ex.submit(sleep_long)
    wait_until(
        lambda: job.get_info().get("State") == "RUNNING", 60, "running, seen through qstat -f"
    )
    job.cancel()
    wait_done(job)
    assert job.state == "CANCELLED"
    assert "qstat -x -f -F json" in fake_bin.log.read_text()


def test_qsub_refusal_is_one_line(pbs: Path) -> None:
    ex = hpc.executor(cluster="pbs", folder=pbs / "jobs", queue="nosuchqueue")
    with pytest.raises(SchedulerError) as exc:
        ex.submit(add, 1, 2)
    assert str(exc.value) == "qsub refused the job (exit 170): qsub: Unknown queue"


def test_submitit_auto_executor_finds_the_pbs_plugin_through_its_entry_points(
    tmp_path: Path,
) -> None:
    """setup.cfg's ``submitit`` entry points name hpc.executors.pbs (hpc_submitit is gone)."""
    from submitit.core import plugins

    plugins.get_executors.cache_clear()
    plugins.get_job_environments.cache_clear()
    assert plugins.get_executors()["pbs"] is sp.PBSExecutor
    assert type(plugins.get_job_environments()["pbs"]) is pbs_env_mod.PBSJobEnvironment
    ex = submitit.AutoExecutor(folder=tmp_path, cluster="pbs")
    assert isinstance(ex._executor, sp.PBSExecutor)
