"""Submit Python functions, not scripts: ``hpc.executor`` and ``hpc.distributed``.

``hpc.executor(cluster="aurora", nodes=2, queue="debug", account="proj")`` returns a
submitit executor configured from the same cluster profile, the same job spec
resolution and the same checks as ``hpc render`` / ``hpc submit``: a bad value raises
the same one-line ``UserError`` the CLI prints. ``executor.submit(fn, *args)`` pickles
the call; ``job.result()`` brings the return value back, ``job.cancel()`` cancels, and
``executor.map_array(fn, items)`` submits one job array.

- SLURM profiles -> ``submitit.SlurmExecutor`` (one srun task per rank);
- PBS profiles -> ``hpc_submitit.pbs.PBSExecutor`` (one mpiexec rank per rank);
- ``local`` -> ``submitit.LocalExecutor`` (processes on this machine);
- ``debug`` -> ``submitit.DebugExecutor`` (in this process, for a debugger).

``hpc.distributed(fn)`` runs ``fn`` on every rank with the environment ``ddp.init()``
needs. submitit starts one process per rank (srun tasks, mpiexec ranks, or the local
executor's tasks); on SLURM and PBS ``ddp.env`` reads the launcher's own variables, and
for the local executor, whose variables ddp does not know, the wrapper exports
torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from submitit's
``JobEnvironment``. submitit keeps every rank's return value: ``job.results()`` is the
list by rank, and ``job.task(0).result()`` is rank 0's (``job.result()`` refuses jobs
with several tasks).

Nothing here imports submitit or torch before it is called, so ``import hpc`` stays
cheap.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hpc.errors import UserError

R = TypeVar("R")

#: Job name when neither the call nor the spec file gives one.
DEFAULT_NAME = "submitit"
#: Keys of a job spec that make no sense here: the function is the command, logs go to ``folder``.
REFUSED = ("command", "output_dir", "wrap")
#: Executor kinds by the profile's scheduler (``debug`` is the local profile run in-process).
KINDS = ("slurm", "pbs", "local", "debug")


def executor(
    cluster: str | None = None,
    nodes: int | None = None,
    ppn: int | None = None,
    walltime: str | int | None = None,
    queue: str | None = None,
    account: str | None = None,
    folder: str | os.PathLike[str] | None = None,
    *,
    spec: str | os.PathLike[str] | None = None,
    name: str | None = None,
    runs_dir: str | os.PathLike[str] = "runs",
    max_num_timeout: int = 3,
    submitit_parameters: dict[str, Any] | None = None,
    **more: Any,
) -> Any:
    """A submitit executor for ``cluster``, checked like ``hpc render`` checks a job.

    ``walltime`` is ``"HH:MM:SS"`` or seconds; ``more`` takes the other job spec keys
    (``env``, ``modules``, ``setup``, ``python``, ``gpus_per_node``, ``cpus_per_task``,
    ``filesystems``, ``signal``, ``requeue``, ``directives``). ``spec`` starts from a
    spec file (its command is ignored), as ``hpc submit SPEC`` does. ``folder`` is
    where pickles and logs go; by default a fresh run directory
    ``runs_dir/NAME-YYYYmmdd-HHMMSS/`` with ``spec.yaml`` and ``run.json`` (the job ids
    are added as jobs are submitted). ``submitit_parameters`` go to the executor's
    ``update_parameters`` unchecked (e.g. ``{"mem_gb": 64}`` on SLURM).
    """
    for key in REFUSED:
        if key in more:
            raise UserError(f"{key}: not taken by hpc.executor; allowed: leave it out (the "
                            "submitted function is the command, logs go to folder)")
    kind_debug = cluster == "debug"
    overrides = {
        "cluster": "local" if kind_debug else cluster, "nodes": nodes, "ppn": ppn,
        "walltime": walltime, "queue": queue, "account": account, "name": name, **more,
    }
    job = resolve(spec, overrides)
    kind = "debug" if kind_debug else job.cluster.scheduler
    if kind == "debug" and job.ranks > 1:
        raise UserError(f"ppn: {job.ppn} is not allowed with cluster 'debug', which runs the "
                        "function once in this process; allowed: 1 (or cluster='local')")
    if job.launcher == "torchrun" and kind == "slurm":
        raise UserError(f"launcher: 'torchrun' cannot start submitit's ranks on {job.cluster.name}; "
                        "allowed: auto, srun (submitit starts one srun task per rank)")

    run_dir = None
    if folder is None:
        from hpc import runs

        run_dir = runs.new_run_dir(Path(runs_dir), job.name)
        target = run_dir
    else:
        if kind == "pbs":  # it becomes the script's #PBS -o/-e paths
            from hpc.spec import _path

            _path(str(folder), "folder")
        target = Path(folder)
    ex = _make(kind, job, target, max_num_timeout, overrides, spec)
    if submitit_parameters:
        try:
            ex.update_parameters(**submitit_parameters)
        except (ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise UserError(f"submitit_parameters: {first}") from None
    if run_dir is not None:
        _write_run_dir(run_dir, job, kind, ex)
    ex._hpc_run_dir = run_dir
    return ex


def resolve(spec: str | os.PathLike[str] | None, overrides: dict[str, Any]) -> Any:
    """Spec file + keyword values -> a resolved ``hpc.spec.Job``, through the CLI's own path.

    ``hpc.cli.build_job`` is what ``hpc render`` calls, so the same input gives the
    same ``UserError``. The command is a placeholder: the function is what runs.
    """
    from hpc.cli import build_job
    from hpc.spec import load_spec

    ov = dict(overrides)
    if ov.get("name") is None and (spec is None or load_spec(str(spec)).name is None):
        ov["name"] = DEFAULT_NAME
    ov["command"] = [sys.executable, "-u", "-m", "submitit.core._submit", "FOLDER"]
    return build_job(None if spec is None else str(spec), ov)


def _make(kind: str, job: Any, folder: Path, max_num_timeout: int,
          overrides: dict[str, Any], spec: Any) -> Any:
    """The executor of ``kind`` for ``job``, its parameters set."""
    if kind == "debug":
        from submitit import DebugExecutor

        return _recording(DebugExecutor)(folder)
    if kind == "local":
        from submitit import LocalExecutor

        ex = _recording(LocalExecutor)(folder, max_num_timeout=max_num_timeout)
        ex.update_parameters(**local_parameters(job))
        return ex
    python = "python" if job.spec.python else None
    if kind == "slurm":
        from submitit import SlurmExecutor

        try:
            ex = _recording(SlurmExecutor)(folder, max_num_timeout=max_num_timeout, python=python)
        except RuntimeError:
            raise UserError(f"cluster: {job.cluster.name} is a SLURM cluster but srun is not on "
                            "PATH here; allowed: a login node of that cluster, or cluster='local' "
                            "/ 'debug' on this machine") from None
        ex.update_parameters(**slurm_parameters(job))
        return ex
    from hpc_submitit.pbs import PBSExecutor

    ex = _recording(PBSExecutor)(folder, max_num_timeout=max_num_timeout, python=python,
                                 cluster=job.cluster.name)
    ex.update_parameters(**pbs_parameters(job))
    return ex


# --- parameters per executor --------------------------------------------------------


def setup_lines(job: Any) -> list[str]:
    """The job's environment block (modules, python env, variables, setup lines), rendered
    from the templates' shared ``_common.sh.j2`` so it matches ``hpc render`` exactly."""
    from hpc.render import context, environment

    text = environment().get_template("_common.sh.j2").render(context(job))
    return [line for line in text.splitlines() if line.strip()]


def _signal(job: Any) -> tuple[str, int]:
    from hpc_submitit.pbs import signal_of

    return signal_of(job.spec.signal)


def slurm_parameters(job: Any) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for a resolved job (see ``_make_sbatch_string``)."""
    cluster = job.cluster
    params: dict[str, Any] = {
        "job_name": job.name,
        "nodes": job.nodes,
        "ntasks_per_node": job.ppn,
        "time": max(1, math.ceil(job.walltime / 60)),
    }
    if job.queue:
        params["qos" if cluster.queue_directive == "qos" else "partition"] = job.queue
    if job.account:
        params["account"] = job.account
    if job.gpus_per_node:
        if cluster.gpu_directive == "gres":
            params["gres"] = f"gpu:{job.gpus_per_node}"
        else:
            params["gpus_per_node"] = job.gpus_per_node
    if job.cpus_per_task:
        params["cpus_per_task"] = job.cpus_per_task
    if cluster.constraint:
        params["constraint"] = cluster.constraint
    srun_args = list(cluster.launcher.args)
    if job.cpus_per_task:  # srun no longer inherits it from sbatch (SLURM >= 22.05)
        srun_args.append(f"--cpus-per-task={job.cpus_per_task}")
    if srun_args:
        params["srun_args"] = srun_args
    setup = setup_lines(job)
    extra: dict[str, Any] = {}
    sig, delay = _signal(job)
    params["signal_delay_s"] = delay
    if sig != "USR2":
        extra["signal"] = f"{sig}@{delay}"
        setup.append(f"export SUBMITIT_PREEMPT_SIGNAL={sig}")
    if job.spec.requeue:
        extra["requeue"] = True
    extra.update(_sbatch_directives(job.spec.directives))
    if setup:
        params["setup"] = setup
    if extra:
        params["additional_parameters"] = extra
    return params


def _sbatch_directives(directives: list[str]) -> dict[str, Any]:
    """``--key=value`` / ``--flag`` directives as submitit's additional_parameters."""
    out: dict[str, Any] = {}
    for d in directives:
        words = shlex.split(d)
        if len(words) != 1 or not words[0].startswith("--"):
            raise UserError(f"directives: {d!r} cannot be passed through submitit; allowed: "
                            "one --key=value or --flag per item, e.g. --mail-type=END")
        key, sep, value = words[0][2:].partition("=")
        out[key] = value if sep else True
    return out


def local_parameters(job: Any) -> dict[str, Any]:
    """submitit LocalExecutor parameters: ranks as tasks, walltime as its timeout."""
    params: dict[str, Any] = {
        "nodes": 1,
        "tasks_per_node": job.ppn,
        "timeout_min": job.walltime / 60,
        "signal_delay_s": _signal(job)[1],
    }
    # LocalExecutor joins setup commands with && in /bin/sh: comments would cut the chain.
    setup = [line for line in setup_lines(job) if not line.lstrip().startswith("#")]
    if setup:
        params["setup"] = setup
    return params


def pbs_parameters(job: Any) -> dict[str, Any]:
    """PBSExecutor parameters: the resolved spec itself (it renders it again, with its own
    command and log folder, through the same template as ``hpc render``)."""
    from hpc_submitit.pbs import SPEC_PARAMETERS

    data = job.to_dict()
    params = {k: data[k] for k in SPEC_PARAMETERS if k in data}
    params["walltime"] = job.walltime
    return params


# --- run directory ------------------------------------------------------------------

_RECORDING: dict[type, type] = {}


def _recording(cls: type) -> type:
    """``cls`` with submissions recorded in the run directory's ``run.json``.

    A subclass of the same name, made once per class, so ``isinstance`` checks and
    submitit's ``Executor.name()`` see the executor they expect.
    """
    if cls not in _RECORDING:
        def _internal_process_submissions(self: Any, delayed_submissions: list[Any]) -> list[Any]:
            jobs = cls._internal_process_submissions(self, delayed_submissions)  # type: ignore[attr-defined]
            run_dir = getattr(self, "_hpc_run_dir", None)
            if run_dir is not None:
                _record_jobs(run_dir, [j.job_id for j in jobs], cls.__name__)
            return jobs

        _RECORDING[cls] = type(cls.__name__, (cls,), {
            "_internal_process_submissions": _internal_process_submissions,
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
        })
    return _RECORDING[cls]


def _scheduler_name(kind: str) -> str:
    return {"debug": "local"}.get(kind, kind)


def _write_run_dir(run_dir: Path, job: Any, kind: str, ex: Any) -> None:
    """``spec.yaml`` (the resolved spec) and ``run.json``, like ``hpc submit`` leaves."""
    import yaml

    from hpc import runs

    data = job.to_dict()
    data["command"] = ["python", "-m", "submitit.core._submit", str(run_dir)]
    (run_dir / "spec.yaml").write_text(
        yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8"
    )
    record = {
        "name": job.name, "cluster": job.cluster.name, "scheduler": _scheduler_name(kind),
        "executor": f"submitit {type(ex).__name__}", "folder": str(run_dir.resolve()),
        "spec": job.spec.source, "cwd": os.getcwd(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "job_id": None, "job_ids": [],
        **runs.git_info(),
    }
    runs.write_record(run_dir, record)


def _record_jobs(run_dir: Path, job_ids: list[str], executor_class: str) -> None:
    """Add submitted ids to ``run.json``; ``job_id`` names the latest (``hpc status RUN``)."""
    from hpc import runs

    try:
        record = runs.read_record(run_dir)
    except UserError:
        return
    if executor_class == "LocalExecutor":  # local job ids are pids; hpc status reads local-PID
        job_ids = [f"local-{j}" for j in job_ids]
    elif executor_class == "PBSExecutor":  # array tasks as PBS names subjobs: 123[4].srv
        from hpc_submitit.pbs import pbs_id

        job_ids = [pbs_id(j) for j in job_ids]
    elif executor_class == "DebugExecutor":
        job_ids = []  # ran (or will run) in this process: nothing to ask a scheduler
    record["job_ids"] = [*record.get("job_ids", []), *job_ids]
    if job_ids:
        record["job_id"] = job_ids[-1]
    runs.write_record(run_dir, record)


# --- several ranks ------------------------------------------------------------------


class Distributed:
    """``fn`` run on every rank of a submitit job with the DDP environment in place.

    A top-level class (not a closure) so that pickle finds it by name on the compute
    node. On the local executor it exports torchrun's variables from submitit's
    JobEnvironment; elsewhere the launcher's own variables (SLURM_PROCID, PALS_RANKID,
    ...) are what ``ddp.env`` reads. A process group ``fn`` leaves open is destroyed
    afterwards, so ranks exit cleanly.
    """

    def __init__(self, fn: Callable[..., R]) -> None:
        if not callable(fn):
            raise TypeError(f"hpc.distributed needs a callable, not {type(fn).__name__}")
        self.fn = fn
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"hpc.distributed({self.fn!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        export_rank_env()
        had_group = _process_group_initialized()
        try:
            return self.fn(*args, **kwargs)
        finally:
            if not had_group:
                _destroy_process_group()


class CheckpointableDistributed(Distributed):
    """A ``Distributed`` around a checkpointable function: submitit calls ``checkpoint``
    on preemption or timeout, and the resubmitted call is wrapped again."""

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        inner = getattr(self.fn, "__submitit_checkpoint__", None) or self.fn.checkpoint  # type: ignore[attr-defined]
        delayed = inner(*args, **kwargs)
        if delayed is not None and not isinstance(delayed.function, Distributed):
            delayed.function = distributed(delayed.function)
        return delayed


def distributed(fn: Callable[..., R]) -> Callable[..., R]:
    """Wrap ``fn`` (or decorate it) to run on every rank; see :class:`Distributed`."""
    if isinstance(fn, Distributed):
        return fn
    if hasattr(fn, "checkpoint") or hasattr(fn, "__submitit_checkpoint__"):
        return CheckpointableDistributed(fn)
    return Distributed(fn)


#: Executors whose launcher variables ddp.env reads itself (srun, PALS/MPICH mpiexec),
#: and the in-process debug executor, which has one rank.
_LAUNCHER_KNOWN = ("slurm", "pbs", "debug")
PORT_BASE, PORT_SPAN, DEFAULT_PORT = 20000, 9000, 29500


def rank_env(env: Any) -> dict[str, str]:
    """torchrun's variables for a rank described by a submitit ``JobEnvironment``.

    The port is derived from the job id (20000 + id % 9000, as ddp.env does for
    SLURM and PBS), so every rank of the job computes the same one.
    """
    digits = "".join(ch for ch in str(env.job_id).split("_")[0] if ch.isdigit())
    port = PORT_BASE + int(digits) % PORT_SPAN if digits else DEFAULT_PORT
    hosts = list(env.hostnames)
    per_node = max(1, env.num_tasks // max(1, env.num_nodes))
    single_node = env.num_nodes <= 1
    return {
        "RANK": str(env.global_rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.num_tasks),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(env.node),
        "NODE_RANK": str(env.node),
        "MASTER_ADDR": "127.0.0.1" if single_node or not hosts else hosts[0],
        "MASTER_PORT": str(port),
    }


def export_rank_env() -> dict[str, str]:
    """Export torchrun's variables when no launcher ddp.env knows has set any; returns them.

    Outside a submitit job (a plain call) and under torchrun this does nothing.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return {}
    try:
        import submitit

        env = submitit.JobEnvironment()
    except RuntimeError:  # not inside a submitit job
        return {}
    if env.cluster in _LAUNCHER_KNOWN:
        return {}
    values = {k: v for k, v in rank_env(env).items() if k not in os.environ}
    os.environ.update(values)
    return values


def _process_group_initialized() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _destroy_process_group() -> None:
    """Close a process group the function left open (only if torch is loaded already)."""
    if _process_group_initialized():
        import torch.distributed as dist

        dist.destroy_process_group()
