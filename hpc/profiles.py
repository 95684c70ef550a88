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

This module finds and merges the files and reads them through the profile's key table
(:data:`PROFILE`, :data:`LAUNCHER`: each key declared once, see :mod:`hpc.schema`); the
nested tables (queues, rules, tiles, charge) and their readers are in
:mod:`hpc.profiles_check`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hpc import schedulers
from hpc._util import did_you_mean, directive_line, directive_value, load_yaml, variable_name
from hpc.cluster import Cluster, Launcher
from hpc.errors import UserError
from hpc.profiles_check import (
    BIN,
    CHARGE,
    DEVICES,
    GPU_DIRECTIVES,
    QUEUE,
    RULE,
    TILES,
    WHEN,
    _charge,
    _device_order,
    _env_prepend,
    _queues,
    _rules,
    _shell,
    _tiles,
    _variables,
    _walltime,
)
from hpc.schema import Key, Table, expect, refuse

__all__ = [
    "BUILTIN_DIR",
    "CLUSTER_KEYS",
    "DEVICES",
    "GPU_DIRECTIVES",
    "LAUNCHER",
    "LAUNCHER_KEYS",
    "MPIEXEC_FLAVORS",
    "POLL_S_RANGE",
    "PROFILE",
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
            PROFILE.check_keys(data, f"cluster {name} ({path})")
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


def _refuse(value: Any, label: str, got: dict[str, Any]) -> dict[str, str]:
    """``refuse: {KIND: why}``: launchers the site warns against, each with its reason."""
    value = value or {}
    if not isinstance(value, dict) or any(k not in launcher_kinds() for k in value):
        raise refuse(
            label,
            value,
            f"a mapping of launcher ({', '.join(launcher_kinds())}) to the reason, one line",
        )
    # null lifts a refusal inherited from a built-in profile (mappings merge per key)
    reasons = {str(k): " ".join(str(v).split()) for k, v in value.items() if v is not None}
    if any(not r for r in reasons.values()):
        raise UserError(f"{label}: every launcher needs a reason; allowed: text")
    return reasons


_ONE_OF: dict[str, Any] = {"kind": "choice", "nullable": False}
_WHOLE: dict[str, Any] = {"kind": "int", "low": 1}
_LINES: dict[str, Any] = {"kind": "strings", "then": directive_line}
#: ``launcher:`` keys (:class:`hpc.cluster.Launcher`); the kind's default is the scheduler's.
LAUNCHER = Table(
    (
        # the choices are read when checked: a launcher may join the table at run time
        Key(
            "kind",
            default=lambda got: got["default"],
            help="how ranks start",
            choices=lambda got: launcher_kinds(),
            **_ONE_OF,
        ),
        Key("flavor", help="mpiexec's flags", choices=MPIEXEC_FLAVORS, **_ONE_OF),
        Key("cpu_bind", help="mpiexec --cpu-bind (list:... or depth)"),
        Key("depth", help="mpiexec --depth: cores per rank", **_WHOLE),
        Key("args", "strings", help="extra launcher arguments"),
        Key("refuse", "custom", help="launchers the site warns against, and why", parse=_refuse),
        Key("concurrent_args", "strings", help="flags for a launch beside the running ranks"),
    ),
    lax=True,
    model=Launcher,
)
LAUNCHER_KEYS = LAUNCHER.names()


def _launcher(value: Any, label: str, got: dict[str, Any]) -> Launcher:
    value = value or {}
    if not isinstance(value, dict):
        raise expect(label, f"a mapping with {', '.join(LAUNCHER_KEYS)}")
    LAUNCHER.check_keys(value, label)
    return Launcher(**LAUNCHER.read(value, label, {"default": _sched(got).launchers[0]}.items()))


def _directive_value(value: Any, label: str, got: dict[str, Any]) -> Any:
    directive_value(value, label)
    return value  # as given: it reaches the script as text either way


def _python_stage(value: Any, label: str, got: dict[str, Any]) -> dict[str, Any]:
    # imported here: only a profile that has python_stage needs it (a ms of hpc's start)
    from hpc import stage

    return stage.profile_rule({"python_stage": value}, got["where"])


def _sched(got: dict[str, Any]) -> Any:
    return schedulers.get(got["scheduler"])


_DIRECTIVE: dict[str, Any] = {"kind": "custom", "parse": _directive_value}
#: Every key of a cluster profile, in the order they are checked (:func:`load`).
PROFILE = Table(
    (
        Key(
            "scheduler",
            default="slurm",
            help="its module in hpc.schedulers",
            choices=lambda got: tuple(schedulers.names()),
            **_ONE_OF,
        ),
        Key("system", help="PBS -l system=", **_DIRECTIVE),
        Key("place", help="PBS -l place=", **_DIRECTIVE),
        Key("filesystems", help="PBS -l filesystems= (a spec may override)", **_DIRECTIVE),
        Key("constraint", help="SLURM --constraint", **_DIRECTIVE),
        Key("env", "custom", help="variables every job exports", parse=_variables),
        Key("device", help="what the ranks drive", choices=DEVICES, **_ONE_OF),
        Key("devices_per_node", help="devices (or GPU tiles) per node", **_WHOLE),
        Key("device_order", "custom", help="device indices by local rank", parse=_device_order),
        Key("description", help="for hpc clusters", nullable=False),
        Key("ppn", help="ranks per node by default", **_WHOLE),
        Key("account_required", "bool", help="a job must name its allocation"),
        Key(
            "account_env", "strings", help="variables the account is read from", then=variable_name
        ),
        Key(
            "queue_directive",
            default=lambda got: _sched(got).queue_directives[0],
            help="how a queue is selected",
            choices=lambda got: _sched(got).queue_directives,
            **_ONE_OF,
        ),
        Key("queues", "custom", help="queue name to limits (QUEUE)", parse=_queues),
        Key("max_nodes", help="the machine's size", **_WHOLE),
        Key("gpu_directive", help="how GPUs are asked for", choices=GPU_DIRECTIVES, **_ONE_OF),
        Key("gpus_per_node", help="GPUs asked for per node", **_WHOLE),
        Key("cpus_per_task", help="cores asked for per rank", **_WHOLE),
        Key(
            "launcher",
            "custom",
            help="how ranks start (LAUNCHER)",
            parse=_launcher,
            required=True,
            nullable=False,
        ),
        Key("module_use", help="module use paths", **_LINES),
        Key("modules", help="modules every job loads", **_LINES),
        Key("setup", "strings", help="shell lines every job runs first"),
        Key("shell", "custom", help="the script's #! interpreter", parse=_shell),
        Key("directives", help="directive lines every job carries", **_LINES),
        Key(
            "min_walltime", "custom", help="the site refuses shorter jobs", parse=_walltime, sep="."
        ),
        Key(
            "env_prepend", "custom", help="NAME: [directory, ...] put in front", parse=_env_prepend
        ),
        Key(
            "poll_s",
            "number",
            help="longest hpc logs -f poll interval",
            low=0.1,
            high=3600.0,
            allowed="seconds, a number from {low:g} to {high:g}",
        ),
        Key("charge", "custom", help="the site's charge unit and factor (CHARGE)", parse=_charge),
        Key(
            "python_stage", "custom", help="when a venv is copied to the nodes", parse=_python_stage
        ),
        Key("tiles", "custom", help="GPUs made of tiles (TILES)", parse=_tiles),
        Key("rules", "custom", help="the site's known issues (RULE)", parse=_rules),
        Key("extends", "meta", help="the profile this one starts from"),
    ),
    lax=True,
    model=Cluster,
)
CLUSTER_KEYS = PROFILE.names()
QUEUE_KEYS, RULE_KEYS, WHEN_KEYS = QUEUE.names(), RULE.names(), WHEN.names()
TILES_KEYS, CHARGE_KEYS, BIN_KEYS = TILES.names(), CHARGE.names(), BIN.names()
#: ``poll_s`` bounds: a tenth of a second (a local job: a pid check, no scheduler) to
#: an hour (longer would leave ``hpc logs -f`` running long after its job ended).
POLL_S_RANGE = (PROFILE["poll_s"].low, PROFILE["poll_s"].high)


def load(name: str, environ: dict[str, str] | None = None, cwd: Path | None = None) -> Cluster:
    """Load, merge and validate the profile ``name``; unknown names get a suggestion."""
    data, sources = _raw(name, environ, cwd)
    where = f"cluster {name}"
    values = PROFILE.read(data, where, {"where": where}.items())
    return Cluster(name=name, sources=tuple(sources), **values)


def load_all(environ: dict[str, str] | None = None, cwd: Path | None = None) -> list[Cluster]:
    """Every profile, loaded and validated (for ``hpc clusters``)."""
    return [load(n, environ, cwd) for n in names(environ, cwd)]
