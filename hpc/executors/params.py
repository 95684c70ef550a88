"""A resolved job as submitit's own executors' parameters (SLURM, local), and the
signal rule every executor shares (the PBS and script executors hold the Job itself)."""

from __future__ import annotations

import math
import shlex
import signal
from typing import Any

from hpc.errors import UserError

#: Seconds before the walltime at which the ranks get the preemption signal.
DEFAULT_SIGNAL_DELAY_S = 90


def setup_lines(job: Any) -> list[str]:
    """The job's environment block (modules, python env, variables, setup lines), rendered
    from the templates' shared ``_common.sh.j2`` so it matches ``hpc render`` exactly."""
    from hpc.render import context, render_template  # the templates' shared block

    text = render_template("_common.sh.j2", context(job))
    return [line for line in text.splitlines() if line.strip()]


def _signal(job: Any) -> tuple[str, int]:
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
        directive = cluster.queue_directive_for(job.queue)  # a queue's own (Frontier's debug QOS)
        params["qos" if directive == "qos" else "partition"] = job.queue
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
    extra.update(_sbatch_directives([*cluster.site_directives(job.queue), *job.spec.directives]))
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
            raise UserError(
                f"directives: {d!r} cannot be passed through submitit; allowed: "
                "one --key=value or --flag per item, e.g. --mail-type=END"
            )
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


def signal_of(spec_signal: str | None, delay: int | None = None) -> tuple[str, int]:
    """(signal name, seconds before the walltime) from a spec's ``signal: [SIG]NAME[@S]``.

    submitit's handler runs in the ranks, so ``B:`` (batch shell only) is refused.
    """
    from submitit.core.job_environment import JobEnvironment

    name, seconds = JobEnvironment.USR_SIG, DEFAULT_SIGNAL_DELAY_S
    if spec_signal:
        text = spec_signal
        if ":" in text:
            raise UserError(
                f"signal: {spec_signal!r}: submitit handles the signal in every rank; "
                "allowed: NAME[@SECONDS] without a B:/R: prefix, e.g. USR2@90"
            )
        text, _, at = text.partition("@")
        name = text.removeprefix("SIG")
        if not hasattr(signal, "SIG" + name):
            raise UserError(f"signal: {spec_signal!r} names no signal; allowed: e.g. USR2@90")
        if at:
            seconds = int(at)
    if delay is not None:
        seconds = int(delay)
    return name, seconds
