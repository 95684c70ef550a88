"""Cluster profiles: the site facts (queues, devices, launcher, modules) as data.

A profile is a YAML file named ``NAME.yaml``. They are read from, in order
(a later directory wins):

1. the built-in profiles in ``hpc/clusters/``;
2. the user's ``$XDG_CONFIG_HOME/hpc-ddp/clusters/`` (``~/.config/hpc-ddp/clusters/``);
3. the project's ``./.hpc/clusters/``;
4. each directory in ``$HPC_DDP_CLUSTERS`` (``os.pathsep``-separated).

Files of the same name are merged per key: a later file's mapping values are
merged into the earlier one recursively (so ``env: {X: "1"}`` adds one variable,
``queues: {debug: {walltime: "00:30:00"}}`` changes one limit); lists and scalars
are replaced. ``extends: NAME`` starts a new profile from another one, so a new
site is one small YAML file. Site knowledge lives here, never in ``if`` statements.

Site rules that are more than a min/max are data too, read by one generic method
each (so a new site never needs code): walltime limits by job size (``bins``), a
minimum walltime (``min_walltime``), queues used only when asked for
(``by_request``), per-queue directives and comments (``directives``, ``notes``), a
queue selected by another directive than the profile's (``directive: qos``), and
launchers a site warns against (``launcher.refuse``). :meth:`Cluster.auto_queues`
and :meth:`Cluster.check_job` are what :mod:`hpc.job` calls.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc import schedulers
from hpc._util import (
    check_keys,
    did_you_mean,
    directive_value,
    format_walltime,
    load_yaml,
    parse_range,
    parse_walltime,
)
from hpc.errors import UserError

BUILTIN_DIR = Path(__file__).resolve().parent / "clusters"
DEVICES = ("xpu", "cuda", "rocm", "cpu", "auto")
GPU_DIRECTIVES = ("none", "gpus-per-node", "gres", "ngpus")
LAUNCHER_KINDS = ("mpiexec", "srun", "torchrun")
MPIEXEC_FLAVORS = ("pals", "hydra")
#: The variable that orders/masks devices, per device kind (``device_order``).
DEVICE_ORDER_VARS = {"cuda": "CUDA_VISIBLE_DEVICES"}
_SHELL = r"^/[A-Za-z0-9_./+-]+( -[A-Za-z]+)?\Z"  # compiled on first use (re's cache)

CLUSTER_KEYS = (
    "description", "scheduler", "device", "devices_per_node", "ppn",
    "account_required", "account_env", "queue_directive", "queues", "max_nodes",
    "system", "place", "filesystems", "constraint", "gpu_directive", "gpus_per_node",
    "cpus_per_task", "launcher", "module_use", "modules", "setup", "env", "extends",
    "shell", "directives", "min_walltime", "device_order", "env_prepend",
)
QUEUE_KEYS = (
    "nodes", "walltime", "bins", "description", "min_walltime", "by_request", "directive",
    "directives", "notes",
)
LAUNCHER_KEYS = ("kind", "flavor", "cpu_bind", "depth", "args", "refuse")


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
    directive: str | None = None  # how this queue is selected when not the profile's queue_directive
    directives: tuple[str, ...] = ()  # extra scheduler directives when this queue is used
    notes: tuple[str, ...] = ()  # comment lines for the script when this queue is used

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
    sources: tuple[str, ...] = ()

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

    def check_job(self, queue: str | None, walltime: int, launcher: str,
                  launchers: tuple[str, ...]) -> None:
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


def profile_dirs(environ: dict[str, str] | None = None, cwd: Path | None = None) -> list[Path]:
    """Directories searched for profiles, lowest precedence first."""
    env = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else cwd
    dirs = [BUILTIN_DIR]
    if env.get("XDG_CONFIG_HOME"):
        dirs.append(Path(env["XDG_CONFIG_HOME"]) / "hpc-ddp" / "clusters")
    elif env.get("HOME"):  # no HOME (e.g. environ={} for reproducible renders): no user dir
        dirs.append(Path(env["HOME"]) / ".config" / "hpc-ddp" / "clusters")
    dirs.append(cwd / ".hpc" / "clusters")
    dirs += [Path(p) for p in env.get("HPC_DDP_CLUSTERS", "").split(os.pathsep) if p]
    return dirs


def names(environ: dict[str, str] | None = None, cwd: Path | None = None) -> list[str]:
    """Every profile name found in any profile directory, sorted."""
    found: set[str] = set()
    for d in profile_dirs(environ, cwd):
        if d.is_dir():
            found.update(p.stem for p in d.glob("*.yaml"))
    return sorted(found)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive per-key merge: mappings merge, everything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _raw(
    name: str, environ: dict[str, str] | None, cwd: Path | None, seen: tuple[str, ...] = ()
) -> tuple[dict[str, Any], list[str]]:
    """The merged mapping for ``name`` (following ``extends``) and the files it came from."""
    merged: dict[str, Any] = {}
    sources: list[str] = []
    for d in profile_dirs(environ, cwd):
        path = d / f"{name}.yaml"
        if path.is_file():
            data = load_yaml(path, f"cluster {name}")
            check_keys(data, CLUSTER_KEYS, f"cluster {name} ({path})")
            merged = _merge(merged, data)
            sources.append(str(path))
    if not sources:
        known = names(environ, cwd)
        raise UserError(
            f"cluster: unknown cluster {name!r}{did_you_mean(name, known)}; "
            f"allowed: {', '.join(known)}"
        )
    base = merged.pop("extends", None)
    if base is not None:
        if base in seen or base == name:
            raise UserError(f"cluster {name}: extends: {base!r} forms a cycle")
        parent, parent_sources = _raw(str(base), environ, cwd, (*seen, name))
        merged = _merge(parent, merged)
        sources = parent_sources + sources
    return merged, sources


def _int(data: dict[str, Any], key: str, where: str, minimum: int = 1) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{where}: {key}: {value!r} is not allowed; allowed: a whole number >= {minimum}")
    return value


def _choice(data: dict[str, Any], key: str, allowed: tuple[str, ...], default: str, where: str) -> str:
    value = str(data.get(key, default))
    if value not in allowed:
        raise UserError(
            f"{where}: {key}: {value!r} is not allowed{did_you_mean(value, allowed)}; "
            f"allowed: {', '.join(allowed)}"
        )
    return value


def _strings(data: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = data.get(key) or []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise UserError(f"{where}: {key}: {value!r} is not allowed; allowed: a list of strings")
    return tuple(str(v) for v in value)


def _directives(data: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    """Directive or comment lines from a profile: text, one line each."""
    lines = _strings(data, key, where)
    for line in lines:
        if any(c in line for c in "\n\r\0"):
            raise UserError(f"{where}: {key}: {line!r} spans lines; allowed: one line per item")
    return lines


def _walltime(data: dict[str, Any], key: str, where: str) -> int | None:
    value = data.get(key)
    return None if value is None else parse_walltime(value, f"{where}.{key}")


def _queues(data: Any, where: str, directives: tuple[str, ...]) -> dict[str, Queue]:
    if not data:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: queues: allowed: a mapping of queue name to limits")
    queues: dict[str, Queue] = {}
    for qname, spec in data.items():
        qwhere = f"{where}: queues.{qname}"
        spec = spec or {}
        if not isinstance(spec, dict):
            raise UserError(f"{qwhere}: allowed: a mapping with nodes and walltime")
        check_keys(spec, QUEUE_KEYS, qwhere)
        lo, hi = parse_range(spec.get("nodes", "1-1000000"), f"{qwhere}.nodes")
        wall = spec.get("walltime")
        limit = parse_walltime(wall, f"{qwhere}.walltime") if wall is not None else None
        bins = []
        for i, b in enumerate(spec.get("bins") or []):
            bwhere = f"{qwhere}.bins[{i}]"
            if not isinstance(b, dict):
                raise UserError(f"{bwhere}: allowed: a mapping with nodes and walltime")
            check_keys(b, ("nodes", "walltime"), bwhere)
            blo, bhi = parse_range(b.get("nodes"), f"{bwhere}.nodes")
            bins.append((blo, bhi, parse_walltime(b.get("walltime"), f"{bwhere}.walltime")))
        by_request = spec.get("by_request", False)
        if not isinstance(by_request, bool):
            raise UserError(f"{qwhere}.by_request: {by_request!r} is not allowed; allowed: true or false")
        directive = None
        if spec.get("directive") is not None:
            directive = _choice(spec, "directive", directives, directives[0], qwhere)
        queues[str(qname)] = Queue(
            name=str(qname), min_nodes=lo, max_nodes=hi, max_walltime=limit, bins=tuple(bins),
            min_walltime=_walltime(spec, "min_walltime", qwhere), by_request=by_request,
            directive=directive, directives=_directives(spec, "directives", qwhere),
            notes=_directives(spec, "notes", qwhere),
        )
    return queues


def _launcher(data: Any, default: str, where: str) -> Launcher:
    data = data or {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: launcher: allowed: a mapping with kind, flavor, cpu_bind, depth, args")
    lwhere = f"{where}: launcher"
    check_keys(data, LAUNCHER_KEYS, lwhere)
    cpu_bind = data.get("cpu_bind")
    refuse = data.get("refuse") or {}
    if not isinstance(refuse, dict) or any(k not in LAUNCHER_KINDS for k in refuse):
        raise UserError(f"{lwhere}: refuse: {refuse!r} is not allowed; allowed: a mapping of "
                        f"launcher ({', '.join(LAUNCHER_KINDS)}) to the reason, one line")
    # null lifts a refusal inherited from a built-in profile (mappings merge per key)
    reasons = {str(k): " ".join(str(v).split()) for k, v in refuse.items() if v is not None}
    if any(not r for r in reasons.values()):
        raise UserError(f"{lwhere}: refuse: every launcher needs a reason; allowed: text")
    return Launcher(
        kind=_choice(data, "kind", LAUNCHER_KINDS, default, lwhere),
        flavor=_choice(data, "flavor", MPIEXEC_FLAVORS, "hydra", lwhere),
        cpu_bind=None if cpu_bind is None else str(cpu_bind),
        depth=_int(data, "depth", lwhere),
        args=_strings(data, "args", lwhere),
        refuse=reasons,
    )


def load(name: str, environ: dict[str, str] | None = None, cwd: Path | None = None) -> Cluster:
    """Load, merge and validate the profile ``name``; unknown names get a suggestion."""
    data, sources = _raw(name, environ, cwd)
    where = f"cluster {name}"
    scheduler = _choice(data, "scheduler", tuple(schedulers.names()), "slurm", where)
    sched = schedulers.get(scheduler)
    for key in ("system", "place", "filesystems", "constraint"):
        if data.get(key) is not None:
            directive_value(data[key], f"{where}: {key}")
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise UserError(f"{where}: env: allowed: a mapping of NAME: value")
    for key in env:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*\Z", str(key)):
            raise UserError(f"{where}: env: {str(key)!r} is not a variable name; "
                            "allowed: letters, digits and _, not starting with a digit")
    device = _choice(data, "device", DEVICES, "auto", where)
    devices_per_node = _int(data, "devices_per_node", where)
    device_order = _device_order(data, device, devices_per_node, where)
    return Cluster(
        name=name,
        scheduler=scheduler,
        description=str(data.get("description", "")),
        device=device,
        devices_per_node=devices_per_node,
        ppn=_int(data, "ppn", where) or 1,
        account_required=bool(data.get("account_required", False)),
        account_env=_strings(data, "account_env", where),
        queue_directive=_choice(
            data, "queue_directive", sched.queue_directives, sched.queue_directives[0], where
        ),
        queues=_queues(data.get("queues"), where, sched.queue_directives),
        max_nodes=_int(data, "max_nodes", where),
        system=data.get("system"),
        place=data.get("place"),
        filesystems=data.get("filesystems"),
        constraint=data.get("constraint"),
        gpu_directive=_choice(data, "gpu_directive", GPU_DIRECTIVES, "none", where),
        gpus_per_node=_int(data, "gpus_per_node", where),
        cpus_per_task=_int(data, "cpus_per_task", where),
        launcher=_launcher(data.get("launcher"), sched.launchers[0], where),
        module_use=_strings(data, "module_use", where),
        modules=_strings(data, "modules", where),
        setup=_strings(data, "setup", where),
        env={str(k): _env_str(v) for k, v in env.items()},
        shell=_shell(data, where),
        directives=_directives(data, "directives", where),
        min_walltime=_walltime(data, "min_walltime", where),
        device_order=device_order,
        env_prepend=_env_prepend(data, where),
        sources=tuple(sources),
    )


def _shell(data: dict[str, Any], where: str) -> str:
    """The script's ``#!`` interpreter: a path and at most one option (``/bin/bash -l``)."""
    shell = str(data.get("shell") or "/bin/bash")
    if not re.match(_SHELL, shell):
        raise UserError(f"{where}: shell: {shell!r} is not allowed; allowed: an absolute path "
                        "and at most one option, e.g. /bin/bash -l")
    return shell


def _device_order(data: dict[str, Any], device: str, devices: int | None, where: str) -> tuple[int, ...]:
    """``device_order``: a permutation of the node's device indices, by local rank."""
    order = data.get("device_order")
    if order is None:
        return ()
    if device not in DEVICE_ORDER_VARS:
        raise UserError(f"{where}: device_order: not available for device {device!r}; "
                        f"allowed: with device {', '.join(DEVICE_ORDER_VARS)}")
    if (not isinstance(order, list) or devices is None
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in order)
            or sorted(order) != list(range(devices))):
        raise UserError(f"{where}: device_order: {order!r} is not allowed; allowed: each of the "
                        f"devices_per_node indices 0-{(devices or 1) - 1} once, e.g. [3, 2, 1, 0]")
    return tuple(order)


def _env_prepend(data: dict[str, Any], where: str) -> dict[str, tuple[str, ...]]:
    """``env_prepend: {VAR: [dir, ...]}``: each dir is put in front of ``$VAR`` in turn."""
    value = data.get("env_prepend") or {}
    if not isinstance(value, dict):
        raise UserError(f"{where}: env_prepend: allowed: a mapping of NAME: [directory, ...]")
    out: dict[str, tuple[str, ...]] = {}
    for key in value:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*\Z", str(key)):
            raise UserError(f"{where}: env_prepend: {str(key)!r} is not a variable name; "
                            "allowed: letters, digits and _, not starting with a digit")
        paths = _strings(value, key, f"{where}: env_prepend")
        if any(not p or ":" in p or "\n" in p or "\0" in p for p in paths):
            raise UserError(f"{where}: env_prepend.{key}: {list(paths)!r} is not allowed; "
                            "allowed: directories without ':' or line breaks")
        out[str(key)] = paths
    return out


def _env_str(value: Any) -> str:
    """YAML scalars as the shell would see them (true -> 1 would surprise; keep text)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return "" if value is None else str(value)


def load_all(environ: dict[str, str] | None = None, cwd: Path | None = None) -> list[Cluster]:
    """Every profile, loaded and validated (for ``hpc clusters``)."""
    return [load(n, environ, cwd) for n in names(environ, cwd)]
