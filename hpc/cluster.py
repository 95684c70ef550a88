"""Cluster profiles as types: a site's facts (queues, devices, launcher, modules) and rules.

``hpc.profiles`` finds, merges and validates the YAML files into these frozen types.
Site rules that are more than a min/max are data too, read by one generic method
each (so a new site never needs code): walltime limits by job size (``bins``), a
minimum walltime (``min_walltime``), queues used only when asked for
(``by_request``), per-queue directives and comments (``directives``, ``notes``), a
queue selected by another directive than the profile's (``directive: qos``), and
launchers a site warns against (``launcher.refuse``). :meth:`Cluster.auto_queues`
and :meth:`Cluster.check_job` are what :mod:`hpc.job` calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpc import schedulers
from hpc._util import format_walltime
from hpc.errors import UserError

#: The variable that orders/masks devices, per device kind (``device_order``).
DEVICE_ORDER_VARS = {"cuda": "CUDA_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class Queue:
    """One queue (PBS queue, SLURM partition or QOS) with its node and walltime limits."""

    name: str
    min_nodes: int
    max_nodes: int
    max_walltime: int | None = None  # seconds; None = no limit known
    bins: tuple[tuple[int, int, int], ...] = ()  # (min nodes, max nodes, walltime) by job size
    min_walltime: int | None = None  # seconds; the site refuses shorter jobs
    by_request: bool = False  # never picked for a job that names no queue
    directive: str | None = (
        None  # how this queue is selected when not the profile's queue_directive
    )
    directives: tuple[str, ...] = ()  # extra scheduler directives when this queue is used
    notes: tuple[str, ...] = ()  # comment lines for the script when this queue is used
    no_dependencies: str | None = None  # the site forbids job dependencies here (why, cited)
    max_queued: int | None = None  # the site's per-user limit of queued jobs here
    #: Most subjobs of one job array eligible (queued or running) at once here: a PBS
    #: array wider than this is throttled with ``%N`` (hpc.sweep.throttle); None = no limit.
    array_limit: int | None = None
    charge_factor: float | None = None  # the site's per-queue/QOS factor; None = unverified
    charge_source: str = ""  # the page that states charge_factor

    def walltime_limit(self, nodes: int) -> int | None:
        """The walltime limit for a job of ``nodes`` nodes (size bins first)."""
        for lo, hi, limit in self.bins:
            if lo <= nodes <= hi:
                return limit
        return self.max_walltime

    def describe(self) -> str:
        """'debug 1-2 nodes, <= 01:00:00' for error messages and tables."""
        if self.bins:
            limit = ", <= " + ", ".join(
                f"{format_walltime(w)} for {lo}-{hi}" for lo, hi, w in self.bins
            )
        else:
            limit = f", <= {format_walltime(self.max_walltime)}" if self.max_walltime else ""
        floor = f", >= {format_walltime(self.min_walltime)}" if self.min_walltime else ""
        ask = f" (by request: --queue {self.name})" if self.by_request else ""
        return f"{self.name} {self.min_nodes}-{self.max_nodes} nodes{limit}{floor}{ask}"


@dataclass(frozen=True)
class Launcher:
    """How ranks are started: mpiexec (PALS or hydra flags), srun, or torchrun."""

    kind: str
    flavor: str = "hydra"
    cpu_bind: str | None = None
    depth: int | None = None
    args: tuple[str, ...] = ()
    refuse: dict[str, str] = field(default_factory=dict)  # launcher kind -> why the site warns
    #: flags for a launch started while the job's ranks run (ddp.supervise's per-node
    #: probe): Aurora's ``--no-vni`` (aurora.yaml cites the known issue)
    concurrent_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tiles:
    """Devices that are tiles of GPUs (``devices_per_node`` counts tiles).

    Why: a rank picks device ``local_rank % count``; with tiles as devices, ``ppn`` equal
    to the GPU count would give ranks 0..5 the two tiles of GPUs 0-2 and leave the rest
    of the node idle. At ``ppn`` <= the GPU count each rank gets a whole GPU instead:
    ``composite_env`` makes every GPU one device (both tiles) and ``composite_cpu_bind``
    spreads the ranks' cores over the sockets the GPUs hang off.
    """

    per_gpu: int
    composite_env: dict[str, str] = field(default_factory=dict)
    composite_cpu_bind: str | None = None
    source: str = ""


@dataclass(frozen=True)
class Rule:
    """One of a site's known issues as data (profile ``rules: {NAME: {...}}``).

    ``when`` is the condition: a node range (``nodes``) and variables of the job's
    environment (``env``: NAME: value, ``null`` for set at all). Where it holds, the rule
    gives defaults (``env``, the spec's own win), drops and unsets variables (``unset``:
    a module may set them too), says one ``warn`` line, or ``refuse``s the job in one
    line. ``enabled: false`` makes a switch a user turns on in their own profile (merged
    per key). Why data: the action depends on the job, never on the site's name.
    """

    name: str
    source: str
    nodes: tuple[int, int] | None = None
    when_env: dict[str, str | None] = field(default_factory=dict)
    enabled: bool = True
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    warn: str | None = None
    refuse: str | None = None

    def holds(self, nodes: int, env: dict[str, str]) -> bool:
        """Whether the rule applies to a job of ``nodes`` nodes with environment ``env``."""
        if not self.enabled:
            return False
        if self.nodes is not None and not self.nodes[0] <= nodes <= self.nodes[1]:
            return False
        return all(
            key in env and (want is None or env[key] == want) for key, want in self.when_env.items()
        )


@dataclass(frozen=True)
class Applied:
    """What a profile's rules made of a job's environment (:meth:`Cluster.apply_rules`)."""

    env: dict[str, str]
    unset: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Layout:
    """Where a job's ranks go on a node: variables, the mpiexec CPU binding, a note."""

    env: dict[str, str] = field(default_factory=dict)
    cpu_bind: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class Cluster:
    """A validated cluster profile."""

    name: str
    scheduler: str
    launcher: Launcher
    description: str = ""
    device: str = "auto"
    devices_per_node: int | None = None
    ppn: int = 1
    account_required: bool = False
    account_env: tuple[str, ...] = ()
    queue_directive: str = "queue"
    queues: dict[str, Queue] = field(default_factory=dict)
    max_nodes: int | None = None
    system: str | None = None
    place: str | None = None
    filesystems: str | None = None
    constraint: str | None = None
    gpu_directive: str = "none"
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    module_use: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    shell: str = "/bin/bash"
    directives: tuple[str, ...] = ()
    min_walltime: int | None = None
    device_order: tuple[int, ...] = ()
    env_prepend: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Longest interval (s) between scheduler queries of ``hpc logs -f``; the default
    #: is a minute, the refresh NCAR's PBS qstat cache serves (see clusters/pbs.yaml).
    poll_s: float = 60.0
    sources: tuple[str, ...] = ()
    #: The site's charge rules (hpc.charges): unit, source URL, machine factor; {} = unknown.
    charge: dict[str, Any] = field(default_factory=dict)
    #: When the job's venv is copied to node-local storage (hpc.stage): min_nodes for
    #: ``stage: auto``, local_dir, source; {} = only when a spec says ``stage: always``.
    python_stage: dict[str, Any] = field(default_factory=dict)
    #: GPUs made of tiles (Aurora); None: each device is a whole GPU (see :class:`Tiles`).
    tiles: Tiles | None = None
    #: The site's known issues as rules (:class:`Rule`), in profile order.
    rules: tuple[Rule, ...] = ()

    @property
    def script_suffix(self) -> str:
        """File suffix of rendered scripts (the scheduler's: .pbs, .slurm or .sh)."""
        return schedulers.get(self.scheduler).script_suffix

    def auto_queues(self) -> list[Queue]:
        """The queues a job that names none may land in, in profile order.

        Why: a by-request queue (Polaris' ``preemptable``, whose jobs may be killed
        without warning) must never be chosen for the user; it is used only when named.
        """
        return [q for q in self.queues.values() if not q.by_request]

    def queue_directive_for(self, queue: str | None) -> str:
        """How ``queue`` is selected in the script: its own ``directive`` or the profile's.

        Why: on Frontier the queue flag is the partition, but the ``debug`` QOS is
        selected with ``-q debug`` on the default partition.
        """
        q = self.queues.get(queue) if queue else None
        return (q.directive if q is not None and q.directive else None) or self.queue_directive

    def site_directives(self, queue: str | None) -> list[str]:
        """The profile's own directives, then those of ``queue`` (e.g. ``-r y``)."""
        q = self.queues.get(queue) if queue else None
        return [*self.directives, *(q.directives if q is not None else ())]

    def queue_notes(self, queue: str | None) -> list[str]:
        """Comment lines the script carries for ``queue`` (e.g. preemption advice)."""
        q = self.queues.get(queue) if queue else None
        return list(q.notes) if q is not None else []

    def layout(self, ppn: int) -> Layout:
        """The rank layout for ``ppn`` ranks per node (see :class:`Tiles`).

        With tiles, ``ppn`` up to the GPU count is one rank per GPU (both tiles, the
        composite variables and CPU list); above it one rank per tile as before. A
        ``ppn`` that leaves devices idle gets a note naming how many, said once by
        :func:`hpc.render.context`; a CPU-only or unknown node gets none.
        """
        devices = self.devices_per_node
        if not devices or self.device == "cpu":
            return Layout(cpu_bind=self.launcher.cpu_bind)
        t = self.tiles
        if t is not None and ppn <= devices // t.per_gpu:
            gpus = devices // t.per_gpu
            idle = gpus - ppn
            note = (
                (
                    f"ppn {ppn}: one rank per GPU (both tiles), {idle} GPU{'s' * (idle != 1)} "
                    f"idle of {gpus} per node on {self.name}; allowed without idle devices: "
                    f"ppn {gpus} (one rank per GPU) or {devices} (one per tile)"
                )
                if idle
                else None
            )
            return Layout(
                dict(t.composite_env), t.composite_cpu_bind or self.launcher.cpu_bind, note
            )
        idle = devices - ppn
        what = "GPU tile" if t is not None else f"{self.device} device"
        note = (
            (
                f"ppn {ppn}: {idle} {what}{'s' * (idle != 1)} idle of {devices} per node on "
                f"{self.name}; allowed without idle devices: ppn {devices}"
            )
            if idle > 0
            else None
        )
        return Layout(cpu_bind=self.launcher.cpu_bind, note=note)

    def apply_rules(
        self, nodes: int, env: dict[str, str], own: frozenset[str] = frozenset()
    ) -> Applied:
        """Apply :attr:`rules` to a job of ``nodes`` nodes whose environment is ``env``
        (``own``: the names the spec sets itself, which a rule's default never replaces).

        A refusing rule raises one UserError line naming the rule, why, and its page;
        every condition is read on ``env`` as the job would have it before any rule.
        """
        out, unset, warnings = dict(env), [], []
        held = [r for r in self.rules if r.holds(nodes, env)]
        for rule in held:
            if rule.refuse:
                raise UserError(f"{self.name} rule {rule.name}: {rule.refuse} ({rule.source})")
        for rule in held:
            for key, value in rule.env.items():
                if key not in own:
                    out[key] = value
            for key in rule.unset:
                out.pop(key, None)
                unset.append(key)
            if rule.warn:
                warnings.append(f"{self.name} rule {rule.name}: {rule.warn} ({rule.source})")
        return Applied(out, tuple(dict.fromkeys(unset)), tuple(warnings))

    def device_order_env(self) -> dict[str, str]:
        """``{CUDA_VISIBLE_DEVICES: "3,2,1,0"}`` for ``device_order``, else nothing.

        Why: a rank picks device index ``local_rank % count`` (``ddp.backends``, and
        torchrun-style scripts use ``cuda:LOCAL_RANK``); listing the devices in the
        order of the ranks' CPU binding makes local rank r drive the device nearest
        its cores, for every launcher and without a per-rank wrapper.
        """
        if not self.device_order:
            return {}
        return {DEVICE_ORDER_VARS[self.device]: ",".join(str(i) for i in self.device_order)}

    def check_job(
        self, queue: str | None, walltime: int, launcher: str, launchers: tuple[str, ...]
    ) -> None:
        """Refuse what the site's rules refuse beyond node and walltime maxima.

        A launcher that the profile's ``launcher.refuse`` names, and a walltime below
        the queue's (else the profile's) ``min_walltime``, each raise one UserError
        line that says why and what is allowed (``launchers``: the scheduler's).
        """
        reason = self.launcher.refuse.get(launcher)
        if reason is not None:
            allowed = ["auto", *(k for k in launchers if k not in self.launcher.refuse)]
            raise UserError(
                f"launcher: {launcher!r} is refused on {self.name}: {reason}; "
                f"allowed: {', '.join(allowed)}"
            )
        q = self.queues.get(queue) if queue else None
        floor = q.min_walltime if q is not None and q.min_walltime else self.min_walltime
        if floor is not None and walltime < floor:
            where = f"queue {q.name} of {self.name}" if q is not None else self.name
            raise UserError(
                f"walltime: {format_walltime(walltime)} is below the minimum of {where}; "
                f"allowed: {format_walltime(floor)} or more"
            )
