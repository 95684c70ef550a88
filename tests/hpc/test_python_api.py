"""``hpc.executor`` / ``hpc.distributed``: the same checks as the CLI, parameters per
executor, laptop executors (local, debug), and real jobs on the SLURM fixture."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cloudpickle
import pytest
import submitit
import yaml

import hpc
from hpc.cli import main as cli_main
from hpc.errors import UserError
from hpc.executors import api, ranks
from hpc.executors import params as exparams
from tests.ddp.launch_utils import clean_env
from tests.support.polling import wait_until

# Job functions travel by value: the compute side need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ACCOUNT_VARS = ("PBS_ACCOUNT", "HPC_ACCOUNT", "SBATCH_ACCOUNT", "SLURM_ACCOUNT")


@pytest.fixture(autouse=True)
def _no_account_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ACCOUNT_VARS:
        monkeypatch.delenv(var, raising=False)


def wait_done(job: Any, timeout: float = 300) -> None:
    """Until ``job`` is done; the bound is against a hang only. A loaded 2-core machine
    took 105 s from submit to a local 2-rank job's end (controller, two interpreters,
    imports), so every job gets the same 300 s whatever it does."""
    wait_until(lambda: job.done(), timeout, f"job {job.job_id} done")


def add(a: int, b: int) -> int:
    return a + b


# --- import cost and the same errors as the CLI ------------------------------------------


def test_import_hpc_stays_free_of_submitit_and_torch() -> None:
    code = (
        "import sys, hpc; hpc.executor; hpc.distributed; "
        "print('submitit' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), check=True, capture_output=True, text=True
    ).stdout
    assert out.split() == ["False", "False"]
    assert hpc.executor is api.executor and hpc.distributed is ranks.distributed


@pytest.mark.parametrize(
    ("kwargs", "flags"),
    [
        ({}, []),
        ({"cluster": "auroar"}, ["--cluster", "auroar"]),
        ({"cluster": "aurora"}, ["--cluster", "aurora"]),  # no account
        (
            {"cluster": "aurora", "nodes": 3, "queue": "debug", "account": "p"},
            ["--cluster", "aurora", "--nodes", "3", "--queue", "debug", "--account", "p"],
        ),
        (
            {"cluster": "aurora", "ppn": 13, "account": "p"},
            ["--cluster", "aurora", "--ppn", "13", "--account", "p"],
        ),
        (
            {"cluster": "aurora", "account": "p", "gpus_per_node": 2},
            ["--cluster", "aurora", "--account", "p", "--gpus-per-node", "2"],
        ),
        (
            {"cluster": "perlmutter", "account": "m1_g", "queue": "debug", "walltime": "01:00:00"},
            [
                "--cluster",
                "perlmutter",
                "--account",
                "m1_g",
                "--queue",
                "debug",
                "--walltime",
                "01:00:00",
            ],
        ),
        ({"cluster": "slurm", "walltime": "1:00"}, ["--cluster", "slurm", "--walltime", "1:00"]),
        ({"cluster": "slurm", "account": "a b"}, ["--cluster", "slurm", "--account", "a b"]),
        ({"cluster": "local", "nodes": 2}, ["--cluster", "local", "--nodes", "2"]),
    ],
)
def test_same_user_error_as_the_cli(
    kwargs: dict[str, Any], flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UserError) as exc:
        hpc.executor(folder=tmp_path, **kwargs)
    assert cli_main(["render", *flags, "--", "python", "train.py"]) == 2
    assert capsys.readouterr().err.strip() == f"hpc: error: {exc.value}"
    assert "\n" not in str(exc.value)
    assert not list(tmp_path.iterdir())  # nothing written before the checks pass


def test_unknown_and_refused_keywords(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"unknown key 'nodez' \(did you mean nodes\?\)"):
        hpc.executor(cluster="local", nodez=2, folder=tmp_path)
    with pytest.raises(UserError, match="^command: not taken by hpc.executor"):
        hpc.executor(cluster="local", command=["python", "x.py"], folder=tmp_path)
    with pytest.raises(UserError, match="^ppn: 2 is not allowed with cluster 'debug'"):
        hpc.executor(cluster="debug", ppn=2, folder=tmp_path)
    with pytest.raises(UserError, match="^launcher: 'torchrun' cannot start submitit's ranks"):
        hpc.executor(cluster="slurm", launcher="torchrun", folder=tmp_path)
    with pytest.raises(UserError, match="^signal: 'B:USR1@60': submitit handles the signal"):
        hpc.executor(cluster="local", signal="B:USR1@60", folder=tmp_path)
    with pytest.raises(UserError, match="^submitit_parameters: "):
        hpc.executor(cluster="local", folder=tmp_path, submitit_parameters={"visible_gpus": 5})


def test_slurm_without_srun_is_a_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError, match="srun is not on PATH"):
        hpc.executor(cluster="slurm", folder=tmp_path / "f")


# --- parameters per executor ----------------------------------------------------------


def test_slurm_parameters_from_the_frontier_profile(tmp_path: Path) -> None:
    from submitit.slurm.slurm import _make_sbatch_string

    value = "a b; $(touch pwned) 'q'"
    job = api.resolve(
        None,
        {
            "cluster": "frontier",
            "account": "proj123",
            "nodes": 2,
            "walltime": "01:30:00",
            "env": {"X": value},
            "directives": ["--mail-type=END"],
            "requeue": True,
        },
    )
    params = exparams.slurm_parameters(job)
    assert params["srun_args"] == ["--gpus-per-task=1", "--gpu-bind=closest", "--cpus-per-task=7"]
    text = _make_sbatch_string(
        command="python -u -m submitit.core._submit F", folder=tmp_path, **params
    )
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=7",
        "#SBATCH --time=90",
        "#SBATCH --partition=batch",
        "#SBATCH --account=proj123",
        "#SBATCH --job-name=submitit",
        "#SBATCH --signal=USR2@90",
        "#SBATCH --requeue",
        "#SBATCH --mail-type=END",
        "module load PrgEnv-gnu",
        "module load rccl-net-plugin",
        "export NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3",
    ):
        assert line in text.splitlines(), line
    export = next(ln for ln in params["setup"] if ln.startswith("export X="))
    shown = subprocess.run(
        ["bash", "-c", f'{export}; printf %s "$X"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert shown == value and not (tmp_path / "pwned").exists()


def test_slurm_qos_constraint_and_signal() -> None:
    job = api.resolve(
        None, {"cluster": "perlmutter", "account": "m1_g", "queue": "debug", "signal": "USR1@120"}
    )
    params = exparams.slurm_parameters(job)
    assert params["qos"] == "debug" and "partition" not in params
    assert params["constraint"] == "gpu" and params["gpus_per_node"] == 4
    assert params["signal_delay_s"] == 120
    assert params["additional_parameters"]["signal"] == "USR1@120"
    assert "export SUBMITIT_PREEMPT_SIGNAL=USR1" in params["setup"]
    with pytest.raises(UserError, match="^directives: '-N 2' cannot be passed"):
        exparams.slurm_parameters(api.resolve(None, {"cluster": "slurm", "directives": ["-N 2"]}))


def test_local_parameters() -> None:
    job = api.resolve(
        None, {"cluster": "local", "ppn": 3, "walltime": "00:02:00", "env": {"A": "x y"}}
    )
    assert exparams.local_parameters(job) == {
        "nodes": 1,
        "tasks_per_node": 3,
        "timeout_min": 2.0,
        "signal_delay_s": 90,
        "setup": ["export A='x y'"],
    }


# --- hpc.distributed --------------------------------------------------------------------


class Resumable(submitit.helpers.Checkpointable):
    """Waits to be interrupted; the checkpoint records it, the requeued run returns."""

    def __init__(self) -> None:
        self.interrupted = 0

    def __call__(self, marker: str) -> tuple[str, int, str]:
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        if self.interrupted:
            return "resumed", self.interrupted, restarts
        Path(marker).write_text("started")
        time.sleep(120)
        return "never interrupted", 0, restarts

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        self.interrupted += 1
        return super().checkpoint(*args, **kwargs)


def test_distributed_wrapper_pickles_and_forwards_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    wrapped = hpc.distributed(add)
    assert not hasattr(wrapped, "checkpoint")  # submitit would call it on preemption
    again = cloudpickle.loads(cloudpickle.dumps(wrapped))
    assert isinstance(again, ranks.Distributed) and again(2, 3) == 5
    assert hpc.distributed(wrapped) is wrapped
    resumable = hpc.distributed(Resumable())
    delayed = resumable.checkpoint("m")  # type: ignore[attr-defined]
    assert isinstance(delayed.function, ranks.Distributed)
    assert delayed.function.fn.interrupted == 1 and delayed.args == ("m",)


def test_rank_env_from_a_job_environment() -> None:
    env = SimpleNamespace(
        job_id="4242",
        global_rank=3,
        local_rank=1,
        num_tasks=4,
        num_nodes=2,
        node=1,
        hostnames=["nodeA", "nodeB"],
    )
    assert ranks.rank_env(env) == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "MASTER_ADDR": "nodeA",
        "MASTER_PORT": "24242",
    }
    one_node = SimpleNamespace(**{**vars(env), "num_nodes": 1, "node": 0, "hostnames": ["vm"]})
    assert ranks.rank_env(one_node)["MASTER_ADDR"] == "127.0.0.1"
    assert ranks.export_rank_env() == {}  # not inside a submitit job: nothing to add


# --- laptop executors (local, debug) -------------------------------------------------------


def test_local_executor_leaves_a_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    ex = hpc.executor(cluster="local", name="adder")
    assert isinstance(ex, submitit.LocalExecutor)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("adder-") and ex.folder == run_dir.resolve()
    spec = yaml.safe_load((run_dir / "spec.yaml").read_text())
    assert (spec["cluster"], spec["name"], spec["ppn"]) == ("local", "adder", 1)
    # what the ranks run, with the executor's folder (the run directory, resolved)
    assert spec["command"] == [sys.executable, "-u", "-m", "submitit.core._submit", str(ex.folder)]
    job = ex.submit(add, 2, 3)
    assert job.result() == 5
    record = yaml.safe_load((run_dir / "run.json").read_text())
    # local-PID-START: the start time, read while the process was there (it is reaped now)
    assert re.fullmatch(f"local-{job.job_id}-[1-9][0-9]*", record["job_id"])
    assert record["scheduler"] == "local"
    wait_until(lambda: not _alive_pid(int(job.job_id)), 60, "the job's shell gone")
    assert cli_main(["status", str(run_dir)]) == 0  # it said UNKNOWN once it had ended
    assert capsys.readouterr().out.split() == [record["job_id"], "COMPLETED"]


def raises(message: str) -> None:
    raise RuntimeError(message)


def test_local_executor_job_that_raised_reads_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    ex = hpc.executor(cluster="local", name="raiser")
    (run_dir,) = (tmp_path / "runs").iterdir()
    job = ex.submit(raises, "boom")
    with pytest.raises(submitit.core.utils.FailedJobError, match="boom"):
        job.result()
    wait_until(lambda: not _alive_pid(int(job.job_id)), 60, "the job's shell gone")
    assert cli_main(["status", str(run_dir)]) == 0
    assert capsys.readouterr().out.split()[1] == "FAILED"


def started_then_sleeps(flag: str) -> str:
    Path(f"{flag}-{os.environ['SUBMITIT_LOCAL_GLOBALID']}").write_text("started")
    time.sleep(600)
    return "slept"


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_local_executor_job_is_seen_by_status_and_stopped_by_cancel(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    sigint: str,
) -> None:
    """What ``hpc.executor``'s docs promise: ``hpc status RUN`` says RUNNING while the
    job runs (from its submission on, through its setup shell) and ``hpc cancel RUN``
    stops it and its ranks. Before, the record held a bare ``local-PID`` and both took
    the job for gone. ``ignored``: submitted from a process that ignores SIGINT (a
    background shell's, nohup's: a loaded run found it), so only the SIGKILL after
    CANCEL_WAIT_S stops it."""
    from hpc.schedulers import local

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(local, "CANCEL_WAIT_S", 3.0)
    ex = hpc.executor(cluster="local", name="napper", ppn=2)
    (run_dir,) = (tmp_path / "runs").iterdir()
    flag = tmp_path / "started"
    old = signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL)
    try:  # what the job inherits (SIG_DFL: Python installs its own KeyboardInterrupt)
        job = ex.submit(started_then_sleeps, str(flag))
    finally:
        signal.signal(signal.SIGINT, old)
    record = yaml.safe_load((run_dir / "run.json").read_text())
    assert record["job_id"].startswith(f"local-{job.job_id}-")

    def state() -> str:
        assert cli_main(["status", str(run_dir)]) == 0
        return capsys.readouterr().out

    assert "RUNNING" in state()  # at once: the shell running its setup lines
    wait_until(
        lambda: all(Path(f"{flag}-{rank}").exists() for rank in (0, 1)),
        120,
        "the job's function started on both ranks",
        ended=lambda: job.state if job.done() else None,
    )
    assert "RUNNING" in state()
    ranks_pids = {
        int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _runs(p, run_dir)
    }
    assert len(ranks_pids) >= 3  # the controller and its two ranks carry the mark
    assert cli_main(["cancel", str(run_dir)]) == 0
    wait_done(job)
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        job.result()
    wait_until(lambda: not any(_alive_pid(p) for p in ranks_pids), 60, "ranks gone")
    capsys.readouterr()  # cancel's "cancel requested"
    assert state().split() == [record["job_id"], "CANCELLED"]  # was UNKNOWN
    capsys.readouterr()
    assert cli_main(["cancel", str(run_dir)]) == 2  # nothing left to cancel
    assert "is not running" in capsys.readouterr().err


def _runs(proc: Path, run_dir: Path) -> bool:
    """Whether /proc/PID is a process of the job in ``run_dir`` (its environment's mark)."""
    try:
        env = (proc / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"HPC_LOCAL_RUN={run_dir.absolute()}".encode() in env


def _alive_pid(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@hpc.distributed
def rank_vars() -> tuple[int, int, int, str]:
    import ddp

    env = ddp.detect()
    return env.rank, env.world_size, env.master_port, env.launcher


def test_local_ranks_get_the_ddp_environment(tmp_path: Path) -> None:
    ex = hpc.executor(cluster="local", ppn=2, folder=tmp_path)
    job = ex.submit(rank_vars)
    wait_done(job)
    (r0, w0, port0, how0), (r1, w1, port1, how1) = job.results()
    assert (r0, w0, r1, w1) == (0, 2, 1, 2) and port0 == port1 and how0 == how1 == "torchrun"
    assert job.task(0).result()[0] == 0


def allreduce_ranks() -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    import ddp

    ctx = ddp.init(backend="gloo", timeout=60)
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    return ctx.rank, ctx.world_size, float(value.item())


def test_local_ranks_form_a_process_group(tmp_path: Path) -> None:
    ex = hpc.executor(cluster="local", ppn=2, folder=tmp_path)
    job = ex.submit(hpc.distributed(allreduce_ranks))
    wait_done(job)
    assert job.results() == [(0, 2, 3.0), (1, 2, 3.0)]


def test_map_array_and_debug(tmp_path: Path) -> None:
    jobs = hpc.executor(cluster="local", folder=tmp_path / "a").map_array(add, [1, 2], [10, 20])
    assert [j.result() for j in jobs] == [11, 22]
    ex = hpc.executor(cluster="debug", folder=tmp_path / "d")
    assert isinstance(ex, submitit.DebugExecutor)
    assert ex.submit(add, 3, 4).result() == 7


# --- real SLURM -----------------------------------------------------------------------------


def slurm_executor(cluster: Any, folder: Path, **kwargs: Any) -> Any:
    return hpc.executor(
        cluster="slurm", queue=cluster.partition, walltime="00:05:00", folder=folder, **kwargs
    )


@pytest.mark.slurm
def test_slurm_ranks(slurm_cluster: Any, tmp_path: Path) -> None:
    ex = slurm_executor(slurm_cluster, tmp_path, nodes=2, ppn=1)
    assert isinstance(ex, submitit.SlurmExecutor)
    job = ex.submit(rank_vars)
    wait_done(job)
    (r0, w0, port0, how0), (r1, w1, port1, how1) = job.results()
    assert [(r0, w0), (r1, w1)] == [(0, 2), (1, 2)]
    assert how0 == how1 == "slurm" and port0 == port1 == 20000 + int(job.job_id) % 9000
    assert "#SBATCH --partition=debug" in job.paths.submission_file.read_text()


def train_weights(steps: int = 3) -> tuple[int, int, list[float], list[list[float]]]:
    """Two DDP ranks on half a batch each; rank 0 also trains one process on the whole
    batch (averaged gradients must give the same weights) and returns the start weights."""
    import torch

    import ddp

    ctx = ddp.init(backend="gloo", timeout=60)

    def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(100)
    data, target = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    model, opt = model_and_opt()
    model = ddp.wrap(model)
    half = slice(4 * ctx.rank, 4 * ctx.rank + 4)
    for _ in range(steps):
        opt.zero_grad()
        ((model(data[half]) - target[half]) ** 2).mean().backward()
        opt.step()
    weights = torch.cat([p.detach().flatten() for p in ddp.unwrap(model).parameters()]).tolist()
    reference: list[list[float]] = []
    if ctx.rank == 0:
        single, single_opt = model_and_opt()
        reference.append(torch.cat([p.detach().flatten() for p in single.parameters()]).tolist())
        for _ in range(steps):
            single_opt.zero_grad()
            ((single(data) - target) ** 2).mean().backward()
            single_opt.step()
        reference.append(torch.cat([p.detach().flatten() for p in single.parameters()]).tolist())
    return ctx.rank, ctx.world_size, weights, reference


@pytest.mark.slurm
def test_slurm_ddp_training(slurm_cluster: Any, tmp_path: Path) -> None:
    ex = slurm_executor(slurm_cluster, tmp_path, nodes=2, ppn=1)
    job = ex.submit(hpc.distributed(train_weights))
    wait_done(job)
    (r0, w0, weights0, (start, single)), (r1, w1, weights1, _) = job.results()
    assert (r0, w0, r1, w1) == (0, 2, 1, 2)
    assert weights0 == weights1  # the ranks agree exactly
    assert weights0 == pytest.approx(single, abs=1e-6)  # DDP = one process on the whole batch
    assert weights0 != pytest.approx(start, abs=1e-3)  # and it did train


@pytest.mark.slurm
def test_slurm_checkpointable_requeued(slurm_cluster: Any, tmp_path: Path) -> None:
    """submitit's own path: --signal=USR2@90 (here sent at once by job._interrupt, i.e.
    scancel --signal), checkpoint, scontrol requeue, the same job id runs again.

    The requeued job waits for its BeginTime, cred_expire after the requeue (10 s on the
    fixture, ~120 s by default), then for a scheduler pass; ``SlurmCluster.release``
    starts it in the next second (within the requeue's own, the node refuses the launch:
    "Job 1 already killed, do not launch batch job", and the job ends FAILED).
    """
    ex = slurm_executor(slurm_cluster, tmp_path)
    marker = tmp_path / "started"
    job = ex.submit(hpc.distributed(Resumable()), str(marker))
    wait_until(marker.exists, 60, "function started")
    job._interrupt()
    seen: set[str] = set()

    def finished() -> bool:
        show = slurm_cluster.run("scontrol", "show", "job", "-o", job.job_id, check=False).stdout
        seen.add(
            " ".join(w for w in show.split() if w.startswith(("JobState=", "Reason=", "Restarts=")))
        )
        if "Restarts=1" in show and "JobState=PENDING" in show:
            slurm_cluster.release(job.job_id)
        return job.done()

    try:
        # a bound against a hang: interrupt, checkpoint, requeue, release, a new batch
        # start and the result take 13 s on a quiet machine, several times that loaded
        wait_until(finished, 180, "requeued job done")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; scontrol saw: {sorted(seen)}") from None
    assert job.result() == ("resumed", 1, "1")
    assert any("Restarts=1" in s and "PENDING" in s for s in seen)
    # logged before scontrol starts: the requeue's SIGKILL (srun's answer to the job's
    # SIGTERM) may end the rank before "Requeued job" (hpc.executors.slurm_env)
    assert f"Requeuing job {job.job_id}" in (job.stdout() or "")


def test_pbs_folder_with_unsafe_characters_is_named_as_folder(tmp_path) -> None:
    import hpc

    with pytest.raises(hpc.UserError, match=r"^folder: .* is not allowed; allowed: a path"):
        hpc.executor(cluster="pbs", folder=str(tmp_path / "a b"))
