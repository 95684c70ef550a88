"""The per-key checks of a cluster profile: each turns one key of the merged YAML mapping
into its ``hpc.cluster`` value (queues, site rules, tiles, ``poll_s``, the shell, device
order, ``env_prepend``, ``charge``) or raises one line naming the profile, the key and
what is allowed. Finding and merging the files, and ``load`` that calls these, is
:mod:`hpc.profiles`."""

from __future__ import annotations

import re
from typing import Any

from hpc import charges
from hpc._util import (
    check_keys,
    did_you_mean,
    directive_line,
    directive_value,
    parse_range,
    parse_walltime,
    variable_name,
)
from hpc.cluster import DEVICE_ORDER_VARS, Cluster, Queue, Rule, Tiles
from hpc.errors import UserError

DEVICES = ("xpu", "cuda", "rocm", "cpu", "auto")
GPU_DIRECTIVES = ("none", "gpus-per-node", "gres", "ngpus")
_SHELL = r"^/[A-Za-z0-9_./+-]+( -[A-Za-z]+)?\Z"  # compiled on first use (re's cache)
RULE_KEYS = ("when", "enabled", "env", "unset", "warn", "refuse", "source")
WHEN_KEYS = ("nodes", "env")
TILES_KEYS = ("per_gpu", "composite_env", "composite_cpu_bind", "source")
QUEUE_KEYS = (
    "nodes",
    "walltime",
    "bins",
    "description",
    "min_walltime",
    "by_request",
    "directive",
    "no_dependencies",
    "max_queued",
    "array_limit",  # issue 32 arrays: most subjobs of an array queued/running at once
    "directives",
    "notes",
    "charge_factor",
    "charge_source",
)


def _int(data: dict[str, Any], key: str, where: str, minimum: int = 1) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(
            f"{where}: {key}: {value!r} is not allowed; allowed: a whole number >= {minimum}"
        )
    return value


def _choice(
    data: dict[str, Any], key: str, allowed: tuple[str, ...], default: str, where: str
) -> str:
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
            raise UserError(
                f"{qwhere}.by_request: {by_request!r} is not allowed; allowed: true or false"
            )
        directive = None
        if spec.get("directive") is not None:
            directive = _choice(spec, "directive", directives, directives[0], qwhere)
        # the name reaches `#SBATCH --partition=NAME` / `#PBS -q NAME`
        queues[str(qname)] = Queue(
            name=directive_value(qname, f"{where}: queues"),
            min_nodes=lo,
            max_nodes=hi,
            max_walltime=limit,
            bins=tuple(bins),
            min_walltime=_walltime(spec, "min_walltime", qwhere),
            by_request=by_request,
            directive=directive,
            directives=_directives(spec, "directives", qwhere),
            notes=_directives(spec, "notes", qwhere),
            no_dependencies=_site_rule(spec, qwhere),
            max_queued=_max_queued(spec, qwhere),
            array_limit=_max_queued(spec, qwhere, "array_limit"),
            charge_factor=charges.factor(spec.get("charge_factor"), f"{qwhere}.charge_factor"),
            charge_source=str(spec.get("charge_source") or ""),
        )
    return queues


def _site_rule(spec: dict[str, Any], where: str) -> str | None:
    """``no_dependencies: "why, with its citation"``: the site forbids chains here."""
    value = spec.get("no_dependencies")
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise UserError(
            f"{where}.no_dependencies: {value!r} is not allowed; allowed: the site's rule in words"
        )
    return value


def _max_queued(spec: dict[str, Any], where: str, key: str = "max_queued") -> int | None:
    """``max_queued: N``: the site's per-user limit of queued jobs in this queue (and
    ``array_limit: N``, the most subjobs of one array it lets be queued or running)."""
    value = spec.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(f"{where}.{key}: {value!r} is not allowed; allowed: a whole number >= 1")
    return value


def _rules(data: Any, where: str) -> tuple[Rule, ...]:
    """``rules: {NAME: {when: {nodes, env}, enabled, env, unset, warn, refuse, source}}``
    (see :class:`hpc.cluster.Rule`); a mapping, so a user's profile can switch one rule
    (``rules: {NAME: {enabled: true}}``) and leave the others; ``null`` removes one."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise UserError(
            f"{where}: rules: allowed: a mapping of NAME: {{when, env, unset, "
            "warn, refuse, source}"
        )
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
            raise UserError(
                f"{rwhere}: source: {source!r} is not allowed; allowed: the URL of "
                "the page that states the issue"
            )
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
        out.append(
            Rule(
                name=str(name),
                source=source,
                nodes=None
                if when.get("nodes") is None
                else parse_range(when["nodes"], f"{rwhere}: when: nodes"),
                when_env={
                    variable_name(str(k), f"{rwhere}: when: env"): (
                        None if v is None else _env_str(v)
                    )
                    for k, v in when_env.items()
                },
                enabled=enabled,
                env={variable_name(str(k), f"{rwhere}: env"): _env_str(v) for k, v in env.items()},
                unset=tuple(
                    variable_name(v, f"{rwhere}: unset") for v in _strings(rule, "unset", rwhere)
                ),
                warn=texts.get("warn"),
                refuse=texts.get("refuse"),
            )
        )
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
        raise UserError(
            f"{twhere}: per_gpu: {data.get('per_gpu')!r} is not allowed; allowed: "
            f"a whole number >= 1 that divides devices_per_node ({devices})"
        )
    env = data.get("composite_env") or {}
    if not isinstance(env, dict):
        raise UserError(f"{twhere}: composite_env: allowed: a mapping of NAME: value")
    bind = data.get("composite_cpu_bind")
    return Tiles(
        per_gpu=per_gpu,
        composite_env={
            variable_name(str(k), f"{twhere}: composite_env"): _env_str(v) for k, v in env.items()
        },
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
    if (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi
    ):  # NaN fails both comparisons
        raise UserError(
            f"{where}: poll_s: {value!r} is not allowed; allowed: seconds, a "
            f"number from {lo:g} to {hi:g}"
        )
    return float(value)


def _shell(data: dict[str, Any], where: str) -> str:
    """The script's ``#!`` interpreter: a path and at most one option (``/bin/bash -l``)."""
    shell = str(data.get("shell") or "/bin/bash")
    if not re.match(_SHELL, shell):
        raise UserError(
            f"{where}: shell: {shell!r} is not allowed; allowed: an absolute path "
            "and at most one option, e.g. /bin/bash -l"
        )
    return shell


def _device_order(
    data: dict[str, Any], device: str, devices: int | None, where: str
) -> tuple[int, ...]:
    """``device_order``: a permutation of the node's device indices, by local rank."""
    order = data.get("device_order")
    if order is None:
        return ()
    if device not in DEVICE_ORDER_VARS:
        raise UserError(
            f"{where}: device_order: not available for device {device!r}; "
            f"allowed: with device {', '.join(DEVICE_ORDER_VARS)}"
        )
    if (
        not isinstance(order, list)
        or devices is None
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in order)
        or sorted(order) != list(range(devices))
    ):
        raise UserError(
            f"{where}: device_order: {order!r} is not allowed; allowed: each of the "
            f"devices_per_node indices 0-{(devices or 1) - 1} once, e.g. [3, 2, 1, 0]"
        )
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
            raise UserError(
                f"{where}: env_prepend.{key}: {list(paths)!r} is not allowed; "
                "allowed: directories without ':' or line breaks"
            )
        out[str(key)] = paths
    return out


def _env_str(value: Any) -> str:
    """YAML scalars as the shell would see them (true -> 1 would surprise; keep text)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return "" if value is None else str(value)


def _charge(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``charge:``: the site's unit, the page defining it and its machine factor (optional)."""
    value = data.get("charge")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{where}: charge: allowed: a mapping with unit, source, factor")
    check_keys(
        value,
        ("unit", "source", "factor", "machine_factor_required", "balance"),
        f"{where}: charge",
    )
    out = {
        "unit": str(value.get("unit", "node-hours")),
        "source": str(value.get("source", "")),
        "factor": charges.factor(value.get("factor"), f"{where}: charge.factor"),
        "machine_factor_required": bool(value.get("machine_factor_required", False)),
    }
    balance = value.get("balance")
    if balance is not None:
        if balance not in charges.BALANCE_COMMANDS:
            raise UserError(
                f"{where}: charge.balance: {balance!r} is not allowed; allowed: "
                + ", ".join(sorted(charges.BALANCE_COMMANDS))
            )
        out["balance"] = balance
    return out
