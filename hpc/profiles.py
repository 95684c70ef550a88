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
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from hpc import charges, schedulers, stage
from hpc._util import (
    check_keys,
    did_you_mean,
    directive_line,
    directive_value,
    load_yaml,
    parse_range,
    parse_walltime,
    variable_name,
)
from hpc.cluster import DEVICE_ORDER_VARS, Cluster, Launcher, Queue, Rule, Tiles
from hpc.errors import UserError

BUILTIN_DIR = Path(__file__).resolve().parent / "clusters"
_LOG = logging.getLogger(__name__)
_ANNOUNCED: set[str] = set()  # profiles from the working directory named on stderr
DEVICES = ("xpu", "cuda", "rocm", "cpu", "auto")
GPU_DIRECTIVES = ("none", "gpus-per-node", "gres", "ngpus")
LAUNCHER_KINDS = tuple(schedulers.LAUNCHERS)
MPIEXEC_FLAVORS = ("pals", "hydra")
_SHELL = r"^/[A-Za-z0-9_./+-]+( -[A-Za-z]+)?\Z"  # compiled on first use (re's cache)
CLUSTER_KEYS = (
    "description", "scheduler", "device", "devices_per_node", "ppn",
    "account_required", "account_env", "queue_directive", "queues", "max_nodes",
    "system", "place", "filesystems", "constraint", "gpu_directive", "gpus_per_node",
    "cpus_per_task", "launcher", "module_use", "modules", "setup", "env", "extends",
    "shell", "directives", "min_walltime", "device_order", "env_prepend", "poll_s",
    "charge", "python_stage", "tiles", "rules",
)
RULE_KEYS = ("when", "enabled", "env", "unset", "warn", "refuse", "source")
WHEN_KEYS = ("nodes", "env")
TILES_KEYS = ("per_gpu", "composite_env", "composite_cpu_bind", "source")
QUEUE_KEYS = (
    "nodes", "walltime", "bins", "description", "min_walltime", "by_request", "directive",
    "no_dependencies", "max_queued",
    "array_limit",  # issue 32 arrays: most subjobs of an array queued/running at once
    "directives", "notes", "charge_factor", "charge_source",
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
    """Directive, comment or module lines from a profile: one line of printable text each."""
    return tuple(directive_line(line, f"{where}: {key}") for line in _strings(data, key, where))


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
        # the name reaches `#SBATCH --partition=NAME` / `#PBS -q NAME`
        queues[str(qname)] = Queue(
            name=directive_value(qname, f"{where}: queues"), min_nodes=lo, max_nodes=hi, max_walltime=limit, bins=tuple(bins),
            min_walltime=_walltime(spec, "min_walltime", qwhere), by_request=by_request,
            directive=directive, directives=_directives(spec, "directives", qwhere),
            notes=_directives(spec, "notes", qwhere),
            no_dependencies=_site_rule(spec, qwhere), max_queued=_max_queued(spec, qwhere),
            array_limit=_max_queued(spec, qwhere, "array_limit"),
            charge_factor=charges.factor(spec.get("charge_factor"), f"{qwhere}.charge_factor"),
            charge_source=str(spec.get("charge_source") or ""),
        )
    return queues


def _site_rule(spec: dict[str, Any], where: str) -> str | None:
    """``no_dependencies: "why, with its citation"``: the site forbids chains here."""
    value = spec.get("no_dependencies")
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise UserError(f"{where}.no_dependencies: {value!r} is not allowed; allowed: the "
                        "site's rule in words")
    return value


def _max_queued(spec: dict[str, Any], where: str, key: str = "max_queued") -> int | None:
    """``max_queued: N``: the site's per-user limit of queued jobs in this queue (and
    ``array_limit: N``, the most subjobs of one array it lets be queued or running)."""
    value = spec.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(f"{where}.{key}: {value!r} is not allowed; allowed: a whole "
                        "number >= 1")
    return value


def _launcher(data: Any, default: str, where: str) -> Launcher:
    data = data or {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: launcher: allowed: a mapping with "
                        f"{', '.join(LAUNCHER_KEYS)}")
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
        account_env=tuple(variable_name(v, f"{where}: account_env")
                          for v in _strings(data, "account_env", where)),
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


def _rules(data: Any, where: str) -> tuple[Rule, ...]:
    """``rules: {NAME: {when: {nodes, env}, enabled, env, unset, warn, refuse, source}}``
    (see :class:`hpc.cluster.Rule`); a mapping, so a user's profile can switch one rule
    (``rules: {NAME: {enabled: true}}``) and leave the others; ``null`` removes one."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise UserError(f"{where}: rules: allowed: a mapping of NAME: {{when, env, unset, "
                        "warn, refuse, source}")
    out = []
    for name, rule in data.items():
        if rule is None:
            continue
        rwhere = f"{where}: rules: {name}"
        if not isinstance(rule, dict):
            raise UserError(f"{rwhere}: allowed: a mapping with {', '.join(RULE_KEYS)}")
        check_keys(rule, RULE_KEYS, rwhere)
        source = str(rule.get("source") or "")
        if not source.startswith(("https://", "http://")):
            raise UserError(f"{rwhere}: source: {source!r} is not allowed; allowed: the URL of "
                            "the page that states the issue")
        when = rule.get("when") or {}
        if not isinstance(when, dict):
            raise UserError(f"{rwhere}: when: allowed: a mapping with {', '.join(WHEN_KEYS)}")
        check_keys(when, WHEN_KEYS, f"{rwhere}: when")
        when_env = when.get("env") or {}
        env = rule.get("env") or {}
        if not isinstance(when_env, dict) or not isinstance(env, dict):
            raise UserError(f"{rwhere}: env: allowed: a mapping of NAME: value")
        texts = {k: " ".join(str(rule[k]).split()) for k in ("warn", "refuse") if rule.get(k)}
        enabled = rule.get("enabled", True)
        if not isinstance(enabled, bool):
            raise UserError(f"{rwhere}: enabled: {enabled!r} is not allowed; allowed: true, false")
        out.append(Rule(
            name=str(name),
            source=source,
            nodes=None if when.get("nodes") is None else parse_range(when["nodes"],
                                                                     f"{rwhere}: when: nodes"),
            when_env={variable_name(str(k), f"{rwhere}: when: env"):
                      (None if v is None else _env_str(v)) for k, v in when_env.items()},
            enabled=enabled,
            env={variable_name(str(k), f"{rwhere}: env"): _env_str(v) for k, v in env.items()},
            unset=tuple(variable_name(v, f"{rwhere}: unset") for v in _strings(rule, "unset",
                                                                                rwhere)),
            warn=texts.get("warn"),
            refuse=texts.get("refuse"),
        ))  # fmt: skip
    return tuple(out)


def _tiles(data: Any, devices: int | None, where: str) -> Tiles | None:
    """``tiles: {per_gpu: 2, composite_env: {...}, composite_cpu_bind: list:..., source: URL}``
    (see :class:`hpc.cluster.Tiles`): ``devices_per_node`` must be a whole number of GPUs."""
    if data is None:
        return None
    twhere = f"{where}: tiles"
    if not isinstance(data, dict):
        raise UserError(f"{twhere}: allowed: a mapping with {', '.join(TILES_KEYS)}")
    check_keys(data, TILES_KEYS, twhere)
    per_gpu = _int(data, "per_gpu", twhere)
    if not per_gpu or not devices or devices % per_gpu:
        raise UserError(f"{twhere}: per_gpu: {data.get('per_gpu')!r} is not allowed; allowed: "
                        f"a whole number >= 1 that divides devices_per_node ({devices})")
    env = data.get("composite_env") or {}
    if not isinstance(env, dict):
        raise UserError(f"{twhere}: composite_env: allowed: a mapping of NAME: value")
    bind = data.get("composite_cpu_bind")
    return Tiles(
        per_gpu=per_gpu,
        composite_env={variable_name(str(k), f"{twhere}: composite_env"): _env_str(v)
                       for k, v in env.items()},
        composite_cpu_bind=None if bind is None else str(bind),
        source=str(data.get("source", "")),
    )


#: ``poll_s`` bounds: a tenth of a second (a local job: a pid check, no scheduler) to
#: an hour (longer would leave ``hpc logs -f`` running long after its job ended).
POLL_S_RANGE = (0.1, 3600.0)


def _poll_s(data: dict[str, Any], where: str) -> float:
    """``poll_s``: the longest interval at which ``hpc logs -f`` asks the scheduler (it
    starts at 1 s and doubles up to this); seconds, a number in :data:`POLL_S_RANGE`."""
    value = data.get("poll_s")
    if value is None:
        return Cluster.poll_s
    lo, hi = POLL_S_RANGE
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not lo <= value <= hi):  # NaN fails both comparisons
        raise UserError(f"{where}: poll_s: {value!r} is not allowed; allowed: seconds, a "
                        f"number from {lo:g} to {hi:g}")
    return float(value)


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
        variable_name(key, f"{where}: env_prepend")
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


def _charge(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``charge:``: the site's unit, the page defining it and its machine factor (optional)."""
    value = data.get("charge")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{where}: charge: allowed: a mapping with unit, source, factor")
    check_keys(value, ("unit", "source", "factor", "machine_factor_required", "balance"),
               f"{where}: charge")
    out = {"unit": str(value.get("unit", "node-hours")), "source": str(value.get("source", "")),
           "factor": charges.factor(value.get("factor"), f"{where}: charge.factor"),
           "machine_factor_required": bool(value.get("machine_factor_required", False))}
    balance = value.get("balance")
    if balance is not None:
        if balance not in charges.BALANCE_COMMANDS:
            raise UserError(f"{where}: charge.balance: {balance!r} is not allowed; allowed: "
                            + ", ".join(sorted(charges.BALANCE_COMMANDS)))
        out["balance"] = balance
    return out
