"""The login side as a library: build, render, submit, status and cancel a job.

``hpc.cli`` is argument parsing and printing over these functions, and the Python
API (``hpc.executors``) builds its jobs through :func:`build_job` too, so a value
is checked the same way wherever it comes from. Nothing here prints.

Building and rendering live here; submitting (:func:`plan_submit`, :func:`submit`:
``hpc.submit``, with a sweep's and a chain's extra jobs in ``hpc.submit_many``) and
status, watch and cancel (``hpc.status``) live in their own modules and are
re-exported here, so ``hpc.core`` stays the one library the CLI and users call.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpc.errors import UserError
from hpc.job import Job, resolve
from hpc.status import (
    cancel,
    combined_state,
    exit_code,
    locate,
    run_status,
    status,
    task_states,
    watch,
)
from hpc.submit import Plan, Submitted, plan_submit, submit

__all__ = [
    "Plan",
    "Submitted",
    "build_job",
    "cancel",
    "combined_state",
    "exit_code",
    "locate",
    "plan_submit",
    "render_all",
    "render_job",
    "run_status",
    "status",
    "submit",
    "task_states",
    "watch",
]


def build_job(
    spec_path: str | None,
    overrides: dict[str, Any],
    environ: Mapping[str, str] | None = None,
    defer_account: bool = False,
    cwd: Path | None = None,
    run_here: bool = False,
) -> Job:
    """Spec file + overrides -> a resolved Job (all checks done, nothing written).

    ``run_here`` is ``hpc run`` of a cluster spec: the same command on this machine,
    one node and one rank unless asked; the site-only keys mean nothing here.
    """
    from hpc import profiles as clusters
    from hpc.spec import load_spec

    environ = os.environ if environ is None else environ
    spec = load_spec(spec_path, overrides)
    if run_here and spec.cluster != "local":
        ppn = str(overrides.get("ppn") or "").strip()
        spec = replace(
            spec,
            cluster="local",
            nodes=int(overrides.get("nodes") or 1),
            ppn=int(ppn) if re.fullmatch("[0-9]+", ppn) else None,
            queue=None,
            account=None,
            gpus_per_node=None,
            filesystems=None,
            launcher="auto",
        )
    if spec.cluster is None:
        raise UserError(
            "cluster: missing; allowed: --cluster NAME or cluster: in the spec, one of "
            + ", ".join(clusters.names(dict(environ), cwd))
        )
    profile = clusters.load(spec.cluster, dict(environ), cwd)
    return resolve(spec, profile, dict(environ), defer_account)


def render_job(
    job: Job, regenerate: str | None = None, templates: str | None = None, script: str | None = None
) -> str:
    """The job script (see :func:`hpc.render.render`)."""
    from hpc.render import render

    return render(job, regenerate=regenerate, templates=templates, script=script)


def render_all(jobs_dir: Path, templates: str | None = None) -> dict[Path, str]:
    """Every ``jobs_dir/*.yaml`` rendered to ``jobs_dir/NAME.{pbs,slurm,sh}``.

    Independent of the caller's environment (no account from ``$PBS_ACCOUNT``, no
    user profiles): the checked-in scripts must be the same on every machine. A
    missing account is left to the submit command (``qsub -A PROJECT``).
    """
    specs = sorted(jobs_dir.glob("*.yaml"))
    if not specs:
        raise UserError(f"--jobs-dir: no *.yaml specs in {str(jobs_dir)!r}")
    out: dict[Path, str] = {}
    for path in specs:
        job = build_job(str(path), {}, environ={}, defer_account=True)
        target = path.with_suffix(job.cluster.script_suffix)
        out[target] = render_job(
            job, regenerate="hpc render --all-jobs", templates=templates, script=str(target)
        )
    return out
