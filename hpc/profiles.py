"""Cluster profiles from YAML: found, merged per key, validated into ``hpc.cluster`` types.

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

This module finds, merges and loads the files (and checks the launcher, whose kinds are
:func:`launcher_kinds`); each other key's check is in :mod:`hpc.profiles_check`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hpc import schedulers, stage
from hpc._util import check_keys, did_you_mean, directive_value, load_yaml, variable_name
from hpc.cluster import Cluster, Launcher
from hpc.errors import UserError
from hpc.profiles_check import (
    DEVICES,
    GPU_DIRECTIVES,
    POLL_S_RANGE,
    QUEUE_KEYS,
    RULE_KEYS,
    TILES_KEYS,
    WHEN_KEYS,
    _charge,
    _choice,
    _device_order,
    _directives,
    _env_prepend,
    _env_str,
    _int,
    _poll_s,
    _queues,
    _rules,
    _shell,
    _strings,
    _tiles,
    _walltime,
)

__all__ = [
    "BUILTIN_DIR",
    "CLUSTER_KEYS",
    "DEVICES",
    "GPU_DIRECTIVES",
    "LAUNCHER_KEYS",
    "MPIEXEC_FLAVORS",
    "POLL_S_RANGE",
    "QUEUE_KEYS",
    "RULE_KEYS",
    "TILES_KEYS",
    "WHEN_KEYS",
    "launcher_kinds",
    "load",
    "load_all",
    "names",
    "profile_dirs",
]

BUILTIN_DIR = Path(__file__).resolve().parent / "clusters"
_LOG = logging.getLogger(__name__)
_ANNOUNCED: set[str] = set()  # profiles from the working directory named on stderr
MPIEXEC_FLAVORS = ("pals", "hydra")
CLUSTER_KEYS = (
    "description",
    "scheduler",
    "device",
    "devices_per_node",
    "ppn",
    "account_required",
    "account_env",
    "queue_directive",
    "queues",
    "max_nodes",
    "system",
    "place",
    "filesystems",
    "constraint",
    "gpu_directive",
    "gpus_per_node",
    "cpus_per_task",
    "launcher",
    "module_use",
    "modules",
    "setup",
    "env",
    "extends",
    "shell",
    "directives",
    "min_walltime",
    "device_order",
    "env_prepend",
    "poll_s",
    "charge",
    "python_stage",
    "tiles",
    "rules",
)
LAUNCHER_KEYS = ("kind", "flavor", "cpu_bind", "depth", "args", "refuse", "concurrent_args")


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
    here = (Path.cwd() if cwd is None else cwd) / ".hpc" / "clusters"
    for d in profile_dirs(environ, cwd):
        path = d / f"{name}.yaml"
        if os.path.lexists(path):  # a pipe or a dangling link is refused, not skipped
            data = load_yaml(path, f"cluster {name}")
            check_keys(data, CLUSTER_KEYS, f"cluster {name} ({path})")
            merged = _merge(merged, data)
            sources.append(str(path))
            if d == here and str(path) not in _ANNOUNCED:
                # its setup lines run in every job: say that the folder changed the profile
                _ANNOUNCED.add(str(path))
                _LOG.warning("cluster %s: using %s from the working directory", name, path)
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


def launcher_kinds() -> tuple[str, ...]:
    """Every kind of the launcher table, read at each check (:data:`hpc.schedulers.LAUNCHERS`:
    a kind added after import is a choice too)."""
    return tuple(schedulers.LAUNCHERS)


def _launcher(data: Any, default: str, where: str) -> Launcher:
    data = data or {}
    kinds = launcher_kinds()
    if not isinstance(data, dict):
        raise UserError(f"{where}: launcher: allowed: a mapping with {', '.join(LAUNCHER_KEYS)}")
    lwhere = f"{where}: launcher"
    check_keys(data, LAUNCHER_KEYS, lwhere)
    cpu_bind = data.get("cpu_bind")
    refuse = data.get("refuse") or {}
    if not isinstance(refuse, dict) or any(k not in kinds for k in refuse):
        raise UserError(
            f"{lwhere}: refuse: {refuse!r} is not allowed; allowed: a mapping of "
            f"launcher ({', '.join(kinds)}) to the reason, one line"
        )
    # null lifts a refusal inherited from a built-in profile (mappings merge per key)
    reasons = {str(k): " ".join(str(v).split()) for k, v in refuse.items() if v is not None}
    if any(not r for r in reasons.values()):
        raise UserError(f"{lwhere}: refuse: every launcher needs a reason; allowed: text")
    return Launcher(
        kind=_choice(data, "kind", kinds, default, lwhere),
        flavor=_choice(data, "flavor", MPIEXEC_FLAVORS, "hydra", lwhere),
        cpu_bind=None if cpu_bind is None else str(cpu_bind),
        depth=_int(data, "depth", lwhere),
        args=_strings(data, "args", lwhere),
        refuse=reasons,
        concurrent_args=_strings(data, "concurrent_args", lwhere),
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
        variable_name(key, f"{where}: env")
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
        account_env=tuple(
            variable_name(v, f"{where}: account_env") for v in _strings(data, "account_env", where)
        ),
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
        module_use=_directives(data, "module_use", where),
        modules=_directives(data, "modules", where),
        setup=_strings(data, "setup", where),
        env={str(k): _env_str(v) for k, v in env.items()},
        shell=_shell(data, where),
        directives=_directives(data, "directives", where),
        min_walltime=_walltime(data, "min_walltime", where),
        device_order=device_order,
        env_prepend=_env_prepend(data, where),
        poll_s=_poll_s(data, where),
        sources=tuple(sources),
        charge=_charge(data, where),
        python_stage=stage.profile_rule(data, where),
        tiles=_tiles(data.get("tiles"), devices_per_node, where),
        rules=_rules(data.get("rules"), where),
    )


def load_all(environ: dict[str, str] | None = None, cwd: Path | None = None) -> list[Cluster]:
    """Every profile, loaded and validated (for ``hpc clusters``)."""
    return [load(n, environ, cwd) for n in names(environ, cwd)]
