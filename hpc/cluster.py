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

CLUSTER_KEYS = (
    "description", "scheduler", "device", "devices_per_node", "ppn",
    "account_required", "account_env", "queue_directive", "queues", "max_nodes",
    "system", "place", "filesystems", "constraint", "gpu_directive", "gpus_per_node",
    "cpus_per_task", "launcher", "module_use", "modules", "setup", "env", "extends",
)
QUEUE_KEYS = ("nodes", "walltime", "bins", "description")
LAUNCHER_KEYS = ("kind", "flavor", "cpu_bind", "depth", "args")


@dataclass(frozen=True)
class Queue:
    """One queue (PBS queue, SLURM partition or QOS) with its node and walltime limits."""

    name: str
    min_nodes: int
    max_nodes: int
    max_walltime: int | None = None  # seconds; None = no limit known
    bins: tuple[tuple[int, int, int], ...] = ()  # (min nodes, max nodes, walltime) by job size

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
        return f"{self.name} {self.min_nodes}-{self.max_nodes} nodes{limit}"


@dataclass(frozen=True)
class Launcher:
    """How ranks are started: mpiexec (PALS or hydra flags), srun, or torchrun."""

    kind: str
    flavor: str = "hydra"
    cpu_bind: str | None = None
    depth: int | None = None
    args: tuple[str, ...] = ()


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
    sources: tuple[str, ...] = ()

    @property
    def script_suffix(self) -> str:
        """File suffix of rendered scripts (the scheduler's: .pbs, .slurm or .sh)."""
        return schedulers.get(self.scheduler).script_suffix


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


def _queues(data: Any, where: str) -> dict[str, Queue]:
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
        queues[str(qname)] = Queue(
            name=str(qname), min_nodes=lo, max_nodes=hi, max_walltime=limit, bins=tuple(bins)
        )
    return queues


def _launcher(data: Any, default: str, where: str) -> Launcher:
    data = data or {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: launcher: allowed: a mapping with kind, flavor, cpu_bind, depth, args")
    lwhere = f"{where}: launcher"
    check_keys(data, LAUNCHER_KEYS, lwhere)
    cpu_bind = data.get("cpu_bind")
    return Launcher(
        kind=_choice(data, "kind", LAUNCHER_KINDS, default, lwhere),
        flavor=_choice(data, "flavor", MPIEXEC_FLAVORS, "hydra", lwhere),
        cpu_bind=None if cpu_bind is None else str(cpu_bind),
        depth=_int(data, "depth", lwhere),
        args=_strings(data, "args", lwhere),
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
    return Cluster(
        name=name,
        scheduler=scheduler,
        description=str(data.get("description", "")),
        device=_choice(data, "device", DEVICES, "auto", where),
        devices_per_node=_int(data, "devices_per_node", where),
        ppn=_int(data, "ppn", where) or 1,
        account_required=bool(data.get("account_required", False)),
        account_env=_strings(data, "account_env", where),
        queue_directive=_choice(
            data, "queue_directive", sched.queue_directives, sched.queue_directives[0], where
        ),
        queues=_queues(data.get("queues"), where),
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
        sources=tuple(sources),
    )


def _env_str(value: Any) -> str:
    """YAML scalars as the shell would see them (true -> 1 would surprise; keep text)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return "" if value is None else str(value)


def load_all(environ: dict[str, str] | None = None, cwd: Path | None = None) -> list[Cluster]:
    """Every profile, loaded and validated (for ``hpc clusters``)."""
    return [load(n, environ, cwd) for n in names(environ, cwd)]
