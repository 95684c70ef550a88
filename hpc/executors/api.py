"""``hpc.executor``: a submitit executor from a cluster profile, and its run directory.

See the package docstring (``hpc.executors``) for what each executor kind is.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from hpc.errors import UserError

#: Job name when neither the call nor the spec file gives one.
DEFAULT_NAME = "submitit"
#: Keys of a job spec that make no sense here: the function is the command, logs go to ``folder``.
REFUSED = ("command", "output_dir", "wrap")


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
    _check_kind(kind, job)
    run_dir = None
    if folder is None:
        from hpc import runs

        run_dir = runs.new_run_dir(Path(runs_dir), job.name)
        target = run_dir
    else:
        if kind == "pbs":  # it becomes the script's #PBS -o/-e paths
            from hpc.spec import path_value

            path_value(str(folder), "folder")
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


def _check_kind(kind: str, job: Any) -> None:
    """What submitit cannot do with this job: several ranks in-process, torchrun on SLURM."""
    if kind == "debug" and job.ranks > 1:
        raise UserError(f"ppn: {job.ppn} is not allowed with cluster 'debug', which runs the "
                        "function once in this process; allowed: 1 (or cluster='local')")
    if job.launcher == "torchrun" and kind == "slurm":
        raise UserError(f"launcher: 'torchrun' cannot start submitit's ranks on {job.cluster.name}; "
                        "allowed: auto, srun (submitit starts one srun task per rank)")


def resolve(spec: str | os.PathLike[str] | None, overrides: dict[str, Any]) -> Any:
    """Spec file + keyword values -> a resolved ``hpc.job.Job``, through the library's path.

    ``hpc.core.build_job`` is what ``hpc render`` calls, so the same input gives the
    same ``UserError``. The command is a placeholder: the function is what runs.
    """
    from hpc.core import build_job
    from hpc.spec import load_spec

    ov = dict(overrides)
    if ov.get("name") is None and (spec is None or load_spec(str(spec)).name is None):
        ov["name"] = DEFAULT_NAME
    ov["command"] = [sys.executable, "-u", "-m", "submitit.core._submit", "FOLDER"]
    return build_job(None if spec is None else str(spec), ov)


def _make(kind: str, job: Any, folder: Path, max_num_timeout: int,
          overrides: dict[str, Any], spec: Any) -> Any:
    """The executor of ``kind`` for ``job``, its parameters set."""
    from hpc.executors import params

    if kind == "debug":
        from submitit import DebugExecutor

        return _recording(DebugExecutor)(folder)
    if kind == "local":
        from submitit import LocalExecutor

        ex = _recording(LocalExecutor)(folder, max_num_timeout=max_num_timeout)
        ex.update_parameters(**params.local_parameters(job))
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
        ex.update_parameters(**params.slurm_parameters(job))
        return ex
    from hpc.executors.pbs import PBSExecutor

    ex = _recording(PBSExecutor)(folder, max_num_timeout=max_num_timeout, python=python,
                                 cluster=job.cluster.name)
    ex.update_parameters(**params.pbs_parameters(job))
    return ex


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
        from hpc.schedulers.pbs import pbs_id

        job_ids = [pbs_id(j) for j in job_ids]
    elif executor_class == "DebugExecutor":
        job_ids = []  # ran (or will run) in this process: nothing to ask a scheduler
    record["job_ids"] = [*record.get("job_ids", []), *job_ids]
    if job_ids:
        record["job_id"] = job_ids[-1]
    runs.write_record(run_dir, record)
