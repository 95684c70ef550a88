"""Resolution: a JobSpec fitted to a cluster profile, every check done, nothing written.

``resolve`` is the one place a spec meets a profile: queue limits and walltime bins,
ppn against the node's devices, the account the site requires, the launcher the
scheduler can start ranks with, and the scheduler's own checks. The result is a
frozen :class:`Job` that templates render and schedulers submit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc import schedulers
from hpc._util import did_you_mean, directive_value, format_walltime, job_name
from hpc.cluster import Cluster
from hpc.errors import UserError
from hpc.schedulers import Scheduler
from hpc.spec import PYTHON, JobSpec

DEFAULT_WALLTIME = 3600


@dataclass(frozen=True)
class Job:
    """A spec fitted to a cluster: every value final, ready to render.

    Frozen: a variant (another output folder, more variables) is ``dataclasses.replace``.
    """

    spec: JobSpec
    cluster: Cluster
    name: str
    nodes: int
    ppn: int
    walltime: int
    queue: str | None
    account: str | None
    account_deferred: bool
    gpus_per_node: int | None
    cpus_per_task: int | None
    launcher: str
    wrapped: bool
    filesystems: str | None
    #: A sweep: the job is an array of this many tasks (``hpc.sweep``), at most
    #: ``max_parallel`` of them running at once (None: the scheduler's limit).
    array_size: int | None = None
    max_parallel: int | None = None
    #: One segment of a chain (``hpc submit --chain N``): the script ends at once when
    #: an earlier segment finished the training (``hpc.chain.DONE`` in the run directory),
    #: and marks it finished when the command exits 0.
    chain: bool = False
    #: The venv copied to node-local storage before the ranks start (``hpc.stage``;
    #: decided by ``hpc submit``, which has the run directory to pack it into).
    stage: Any = None

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of this job's cluster."""
        return schedulers.get(self.cluster.scheduler)

    def with_spec(self, **changes: Any) -> Job:
        """This job with spec fields changed that need no new resolution (env, output_dir, ...)."""
        return replace(self, spec=replace(self.spec, **changes))

    @property
    def ranks(self) -> int:
        """Total number of processes."""
        return self.nodes * self.ppn

    def to_dict(self) -> dict[str, Any]:
        """The resolved spec as written to a run directory (loadable as a spec again)."""
        s = self.spec
        out: dict[str, Any] = {
            "name": self.name,
            "cluster": self.cluster.name,
            "nodes": self.nodes,
            "ppn": self.ppn,
            "walltime": format_walltime(self.walltime),
            "queue": self.queue,
            "account": self.account,
            "command": list(s.command),
            "env": dict(s.env),
            "modules": list(s.modules),
            "setup": list(s.setup),
            "python": s.python,
            "output_dir": s.output_dir,
            "signal": s.signal,
            "requeue": s.requeue,
            "directives": list(s.directives),
            "launcher": self.launcher,
            "gpus_per_node": self.gpus_per_node,
            "cpus_per_task": self.cpus_per_task,
            "wrap": "always" if self.wrapped else "never",
            "filesystems": self.filesystems,
            "expand_vars": s.expand_vars or None,  # absent when off: older run records alike
            "split_logs": s.split_logs or None,
            "per_rank_logs": s.per_rank_logs or None,
            "resilience": dict(s.resilience) if s.resilience else None,
        }
        if s.description:
            out["description"] = s.description
        return {k: v for k, v in out.items() if v not in (None, [], {})}


def is_ddp_command(command: list[str]) -> bool:
    """True for this project's entry points, which read any launcher's variables themselves."""
    if not command:
        return False
    if Path(command[0]).name in ("ddp-exec",):
        return True
    return (
        bool(re.match(PYTHON, command[0]))
        and len(command) >= 3
        and command[1] == "-m"
        and command[2] in ("ddp", "ddp.exec")
    )


def default_name(command: list[str]) -> str:
    """A name from the command: the recipe, the script stem, or the program."""
    if is_ddp_command(command) and len(command) > 3:
        return command[3]
    for word in command[1:] if command and re.match(PYTHON, command[0]) else command:
        if word.endswith(".py"):
            return Path(word).stem
    if command and re.match(PYTHON, command[0]) and "-m" in command[:-1]:
        return command[command.index("-m") + 1].split(".")[-1]
    return Path(command[0]).name if command else "job"


def _pick_queue(spec: JobSpec, cluster: Cluster, nodes: int) -> tuple[str | None, int]:
    """Check or choose the queue; return it with the walltime (seconds) to ask for."""
    queues = cluster.queues
    if spec.queue is not None:
        if not queues:  # no site facts: any name goes, nothing to check
            return spec.queue, spec.walltime or DEFAULT_WALLTIME
        q = queues.get(spec.queue)
        if q is None:
            raise UserError(
                f"queue: {spec.queue!r} is not a queue of {cluster.name}"
                f"{did_you_mean(spec.queue, queues)}; allowed: {', '.join(queues)}"
            )
        if not q.min_nodes <= nodes <= q.max_nodes:
            raise UserError(
                f"nodes: {nodes} does not fit queue {q.name} of {cluster.name}; "
                f"allowed: {q.min_nodes}-{q.max_nodes}{_fits(cluster.auto_queues(), nodes, None)}"
            )
        limit = q.walltime_limit(nodes)
        walltime = spec.walltime or min(DEFAULT_WALLTIME, limit or DEFAULT_WALLTIME)
        if limit is not None and walltime > limit:
            raise UserError(
                f"walltime: {format_walltime(walltime)} exceeds queue {q.name} of {cluster.name} "
                f"for {nodes} nodes; allowed: up to {format_walltime(limit)}"
                f"{_fits(cluster.auto_queues(), nodes, walltime)}"
            )
        return q.name, walltime
    if not queues:
        return None, spec.walltime or DEFAULT_WALLTIME
    walltime = spec.walltime or DEFAULT_WALLTIME
    for q in cluster.auto_queues():
        limit = q.walltime_limit(nodes)
        if q.min_nodes <= nodes <= q.max_nodes and (limit is None or walltime <= limit):
            return q.name, walltime
    raise UserError(
        f"nodes/walltime: no queue of {cluster.name} takes {nodes} nodes for "
        f"{format_walltime(walltime)}; allowed: " + "; ".join(q.describe() for q in queues.values())
    )


def _fits(queues: Any, nodes: int, walltime: int | None) -> str:
    """' (queue X fits)' to point at a queue that would take the job."""
    for q in queues:
        limit = q.walltime_limit(nodes)
        if q.min_nodes <= nodes <= q.max_nodes and (
            walltime is None or limit is None or walltime <= limit
        ):
            return f" (queue {q.name} takes it)"
    return ""


def resolve(
    spec: JobSpec,
    cluster: Cluster,
    environ: dict[str, str] | None = None,
    defer_account: bool = False,
) -> Job:
    """Fit ``spec`` to ``cluster``; every check happens here, before anything is written.

    ``environ`` supplies the account variables (``PBS_ACCOUNT``, ``SBATCH_ACCOUNT``,
    ``HPC_ACCOUNT`` as the profile lists); pass ``{}`` for renders that must not
    depend on the caller's environment. ``defer_account`` allows a missing account
    on a site that requires one: the directive is left out, to be given at submit
    time (``qsub -A PROJECT script``).
    """
    environ = {} if environ is None else environ
    if not spec.command:
        raise UserError(
            "command: missing; allowed: a list in the spec (command: [python, train.py]) "
            "or the words after -- on the command line"
        )
    nodes = spec.nodes
    if cluster.max_nodes is not None and nodes > cluster.max_nodes:
        raise UserError(
            f"nodes: {nodes} exceeds what {cluster.name} offers; allowed: 1-{cluster.max_nodes}"
        )
    ppn = spec.ppn or cluster.ppn
    if cluster.devices_per_node is not None and ppn > cluster.devices_per_node:
        raise UserError(
            f"ppn: {ppn} exceeds the {cluster.devices_per_node} {cluster.device} devices per node "
            f"of {cluster.name}; allowed: 1-{cluster.devices_per_node}"
        )
    queue, walltime = _pick_queue(spec, cluster, nodes)
    account, deferred = _account(spec, cluster, environ, defer_account)
    scheduler = schedulers.get(cluster.scheduler)
    launcher = cluster.launcher.kind if spec.launcher == "auto" else spec.launcher
    if launcher not in scheduler.launchers:
        raise UserError(
            f"launcher: {launcher!r} is not available on {cluster.name} ({cluster.scheduler}); "
            f"allowed: auto, {', '.join(scheduler.launchers)}"
        )
    cluster.check_job(queue, walltime, launcher, scheduler.launchers)
    if spec.wrap == "auto":  # torchrun already exports RANK/LOCAL_RANK/...; mpiexec and srun do not
        wrapped = schedulers.LAUNCHERS[launcher].per_rank and not is_ddp_command(spec.command)
    else:
        wrapped = spec.wrap == "always"
    scheduler.check_spec(spec, cluster)
    return Job(
        spec=spec,
        cluster=cluster,
        name=job_name(spec.name or default_name(spec.command)),
        nodes=nodes,
        ppn=ppn,
        walltime=walltime,
        queue=queue,
        account=account,
        account_deferred=deferred,
        gpus_per_node=_gpus(spec, cluster),
        cpus_per_task=spec.cpus_per_task or cluster.cpus_per_task,
        launcher=launcher,
        wrapped=wrapped,
        filesystems=spec.filesystems or cluster.filesystems,
    )


def _account(
    spec: JobSpec, cluster: Cluster, environ: dict[str, str], defer: bool
) -> tuple[str | None, bool]:
    """(account, deferred): the spec's, else the first of the profile's variables set;
    a site that requires one refuses none unless it is deferred to submit time."""
    account = spec.account
    if account is None:
        for var in cluster.account_env:
            if environ.get(var):
                account = directive_value(environ[var], f"account (from ${var})")
                break
    if account is None and cluster.account_required:
        if not defer:
            envs = "/".join(cluster.account_env) or "HPC_ACCOUNT"
            raise UserError(
                f"account: missing; {cluster.name} requires a project allocation; allowed: "
                f"--account PROJECT, account: in the spec, or ${envs}"
            )
        return None, True
    return account, False


def _gpus(spec: JobSpec, cluster: Cluster) -> int | None:
    """GPUs per node to ask for: the spec's (checked against the node), else the profile's."""
    gpus = spec.gpus_per_node
    if gpus is None:
        return cluster.gpus_per_node if cluster.gpu_directive != "none" else None
    if cluster.gpu_directive == "none":
        raise UserError(
            f"gpus_per_node: {gpus} cannot be asked for on {cluster.name}, which allocates "
            "whole nodes; allowed: leave it out"
        )
    if cluster.devices_per_node is not None and gpus > cluster.devices_per_node:
        raise UserError(
            f"gpus_per_node: {gpus} exceeds the {cluster.devices_per_node} devices per node "
            f"of {cluster.name}; allowed: 1-{cluster.devices_per_node}"
        )
    return gpus
