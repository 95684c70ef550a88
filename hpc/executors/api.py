"""``hpc.executor``: a submitit executor from a cluster profile, and its run directory.

See the package docstring (``hpc.executors``) for what each executor kind is.
"""

from __future__ import annotations

import os
import shlex
import sys
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
            raise UserError(
                f"{key}: not taken by hpc.executor; allowed: leave it out (the "
                "submitted function is the command, logs go to folder)"
            )
    debug = cluster == DEBUG  # the keyword's own value, not a profile or scheduler
    overrides = {
        "cluster": "local" if debug else cluster,
        "nodes": nodes,
        "ppn": ppn,
        "walltime": walltime,
        "queue": queue,
        "account": account,
        "name": name,
        **more,
    }
    job = resolve(spec, overrides)
    if debug and job.ranks > 1:
        raise UserError(
            f"ppn: {job.ppn} is not allowed with cluster 'debug', which runs the "
            "function once in this process; allowed: 1 (or cluster='local')"
        )
    run_dir = None
    if folder is None:
        from hpc import runs

        run_dir = target = runs.new_run_dir(Path(runs_dir), job.name)
    else:
        target = Path(folder)
    try:
        ex = _make(job, target, max_num_timeout, run_dir, debug)
        if submitit_parameters:
            try:
                ex.update_parameters(**submitit_parameters)
            except (ValueError, TypeError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                raise UserError(f"submitit_parameters: {first}") from None
    except BaseException:
        if run_dir is not None:  # refused: no run directory of a job never submitted
            _discard(run_dir)
        raise
    if run_dir is not None:
        _write_run_dir(run_dir, job, ex)
    return ex


#: ``cluster=`` value that runs the function in this process (submitit's DebugExecutor).
DEBUG = "debug"


def _make(job: Any, folder: Path, max_num_timeout: int, run_dir: Path | None, debug: bool) -> Any:
    """The executor for ``job``: the scheduler's own (``Scheduler.submitit_executor``), or
    submitit's DebugExecutor for ``cluster='debug'``."""
    if debug:
        from submitit import DebugExecutor

        return DebugExecutor(folder)
    return job.scheduler.submitit_executor(job, folder, max_num_timeout, run_dir)


def _discard(run_dir: Path) -> None:
    """Remove a run directory this call made and left empty (or holding only its lock)."""
    import shutil

    names = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    if names <= {".lock"}:
        shutil.rmtree(run_dir, ignore_errors=True)


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


def _write_run_dir(run_dir: Path, job: Any, ex: Any) -> None:
    """``spec.yaml`` (the resolved spec) and ``run.json`` (``hpc.runs.new_record``, as
    ``hpc submit`` writes it), so ``hpc status/logs/cancel RUN`` work on it."""
    import yaml

    from hpc import runs

    data = job.to_dict()
    # what each rank runs (hpc.executors.slurm_env on SLURM, hpc.executors.pbs on PBS);
    # submitit's DebugExecutor runs the call in this process and has no command
    command = getattr(ex, "_submitit_command_str", None)
    data["command"] = shlex.split(command) if command else ["(debug: in the submitting process)"]
    (run_dir / "spec.yaml").write_text(
        yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8"
    )
    record = runs.new_record(
        job,
        runs.git_info(),
        job_ids=[],
        folder=str(run_dir.resolve()),
        executor=f"submitit {type(ex).__name__}",
    )
    runs.write_record(run_dir, record)
