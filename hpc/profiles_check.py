"""The cluster profile's nested mappings as key tables (:mod:`hpc.schema`), and the
readers of the keys whose value is a structure of its own (queues, site rules, tiles,
device order, ``env_prepend``, ``charge``). Each raises one line naming the profile, the
key and what is allowed. The top-level table and ``load`` are in :mod:`hpc.profiles`."""

from __future__ import annotations

import re
from typing import Any

from hpc import charges, schedulers
from hpc._util import directive_line, directive_value, parse_range, parse_walltime, variable_name
from hpc.cluster import DEVICE_ORDER_VARS, Queue, Rule, Tiles
from hpc.errors import UserError
from hpc.schema import Key, Table, expect, refuse

DEVICES = ("xpu", "cuda", "rocm", "cpu", "auto")
GPU_DIRECTIVES = ("none", "gpus-per-node", "gres", "ngpus")
_SHELL = r"^/[A-Za-z0-9_./+-]+( -[A-Za-z]+)?\Z"  # compiled on first use (re's cache)


def _env_str(value: Any) -> str:
    """YAML scalars as the shell would see them (true -> 1 would surprise; keep text)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return "" if value is None else str(value)


def _variables(value: Any, label: str, got: dict[str, Any]) -> dict[str, str]:
    """``NAME: value`` pairs a job exports (``env``, a rule's ``env``, ``composite_env``)."""
    value = value or {}
    if not isinstance(value, dict):
        raise expect(label, "a mapping of NAME: value")
    return {variable_name(str(k), label): _env_str(v) for k, v in value.items()}


def _walltime(value: Any, label: str, got: dict[str, Any]) -> int:
    return parse_walltime(value, label)


def _range(value: Any, label: str, got: dict[str, Any]) -> tuple[int, int]:
    return parse_range(value, label)


def _site_rule(value: Any, label: str, got: dict[str, Any]) -> str:
    """``no_dependencies: "why, with its citation"``: the site forbids chains here."""
    if not isinstance(value, str) or not value.strip():
        raise refuse(label, value, "the site's rule in words")
    return value


def _factor(value: Any, label: str, got: dict[str, Any]) -> float | None:
    return charges.factor(value, label)


def _bins(value: Any, label: str, got: dict[str, Any]) -> tuple[tuple[int, int, int], ...]:
    """Walltime limits by job size: ``[{nodes: MIN-MAX, walltime: HH:MM:SS}, ...]``."""
    bins = []
    if not value:
        return ()
    # iterated as before (a mapping by its keys); a number, once a traceback, is one item
    for i, b in enumerate(value if isinstance(value, (list, dict, str)) else [value]):
        bwhere = f"{label}[{i}]"
        if not isinstance(b, dict):
            raise expect(bwhere, "a mapping with nodes and walltime")
        BIN.check_keys(b, bwhere)
        got = BIN.read(b, bwhere)
        bins.append((*got["nodes"], got["walltime"]))
    return tuple(bins)


_NODES = "the node range MIN-MAX"
#: One size bin of a queue's walltime limits (both keys required).
BIN = Table(
    (
        Key("nodes", "custom", help=_NODES, parse=_range, nullable=False, required=True),
        Key("walltime", "custom", help="HH:MM:SS", parse=_walltime, nullable=False, required=True),
    ),
    sep=".",
)
_LINES: dict[str, Any] = {"kind": "strings", "then": directive_line}
_WHOLE: dict[str, Any] = {"kind": "int", "low": 1}
#: A queue's keys (``queues: {NAME: {...}}``), in the order they are checked.
QUEUE = Table(
    (
        Key("nodes", "custom", (1, 1_000_000), _NODES, parse=_range, nullable=False),
        Key("walltime", "custom", help="the longest walltime (HH:MM:SS)", parse=_walltime),
        Key("bins", "custom", help="walltime limits by job size", parse=_bins),
        Key("description", help="what the queue is for, for people"),
        Key("by_request", "bool", help="used only when a job names it", nullable=False),
        Key(
            "directive",
            "choice",
            help="how this queue is selected when not the profile's queue_directive",
            choices=lambda got: got["directives"],
            sep=": ",
        ),
        Key("min_walltime", "custom", help="the site refuses shorter jobs", parse=_walltime),
        Key("directives", help="directives when this queue is used", sep=": ", **_LINES),
        Key("notes", help="comment lines when this queue is used", sep=": ", **_LINES),
        Key("no_dependencies", "custom", help="why the site forbids chains", parse=_site_rule),
        Key("max_queued", help="the site's per-user limit of queued jobs", **_WHOLE),
        Key("array_limit", help="most subjobs of one array at once", **_WHOLE),
        Key("charge_factor", "custom", help="the site's factor (cited)", parse=_factor),
        Key("charge_source", "text", help="the page that states charge_factor"),
    ),
    sep=".",
    lax=True,
    model=Queue,
)


def _queues(value: Any, label: str, got: dict[str, Any]) -> dict[str, Queue]:
    """``queues: {NAME: {...}}`` (:data:`QUEUE`); the name reaches ``--partition=NAME``."""
    if not value:
        return {}
    if not isinstance(value, dict):
        raise expect(label, "a mapping of queue name to limits")
    given = {"directives": schedulers.get(got["scheduler"]).queue_directives}
    queues: dict[str, Queue] = {}
    for qname, spec in value.items():
        qwhere = f"{label}.{qname}"
        spec = spec or {}
        if not isinstance(spec, dict):
            raise expect(qwhere, "a mapping with nodes and walltime")
        QUEUE.check_keys(spec, qwhere)
        q = QUEUE.read(spec, qwhere, given.items())
        (lo, hi), limit = q.pop("nodes"), q.pop("walltime")
        del q["description"]
        queues[str(qname)] = Queue(directive_value(qname, label), lo, hi, limit, **q)
    return queues


def _as_given(value: Any, label: str, got: dict[str, Any]) -> Any:
    return value  # checked by the caller, once the rest of the rule is read


def _url(value: Any, label: str, got: dict[str, Any]) -> str:
    source = str(value or "")
    if not source.startswith(("https://", "http://")):
        raise refuse(label, source, "the URL of the page that states the issue")
    return source


def _line(value: Any, label: str, got: dict[str, Any]) -> str | None:
    return " ".join(str(value).split()) if value else None


#: A site rule's ``when:`` (both keys optional: no condition holds always).
WHEN = Table(
    (
        Key("nodes", "custom", help="the node range it holds for", parse=_range),
        Key("env", "custom", {}, "NAME: value (null: set at all)", parse=_as_given),
    )
)
#: A site rule's keys (``rules: {NAME: {...}}``; see :class:`hpc.cluster.Rule`).
RULE = Table(
    (
        Key("when", "custom", {}, "the condition: nodes, env", parse=_as_given),
        Key(
            "enabled",
            "bool",
            help="false: a switch a user turns on",
            allowed="true, false",
            nullable=False,
        ),
        Key("env", "custom", help="variables it sets (the spec's own win)", parse=_as_given),
        Key("unset", "strings", help="variables it unsets", then=variable_name),
        Key("warn", "custom", help="one line said when it holds", parse=_line),
        Key("refuse", "custom", help="one line refusing the job", parse=_line),
        Key(
            "source",
            "custom",
            help="the page that states the issue",
            parse=_url,
            required=True,
            nullable=False,
        ),
    ),
    lax=True,
    model=Rule,
)


def _rules(value: Any, label: str, got: dict[str, Any]) -> tuple[Rule, ...]:
    """``rules: {NAME: {when: {nodes, env}, enabled, env, unset, warn, refuse, source}}``
    (see :class:`hpc.cluster.Rule`); a mapping, so a user's profile can switch one rule
    (``rules: {NAME: {enabled: true}}``) and leave the others; ``null`` removes one."""
    if not isinstance(value, dict):
        raise expect(label, "a mapping of NAME: {when, env, unset, warn, refuse, source}")
    out = []
    for name, rule in value.items():
        if rule is None:
            continue
        rwhere = f"{label}: {name}"
        if not isinstance(rule, dict):
            raise expect(rwhere, f"a mapping with {', '.join(RULE.names())}")
        RULE.check_keys(rule, rwhere)
        r = RULE.read(rule, rwhere)
        when = r.pop("when") or {}
        if not isinstance(when, dict):
            raise expect(f"{rwhere}: when", f"a mapping with {', '.join(WHEN.names())}")
        WHEN.check_keys(when, f"{rwhere}: when")
        w = WHEN.read(when, f"{rwhere}: when")
        if not isinstance(w["env"] or {}, dict) or not isinstance(r["env"] or {}, dict):
            raise expect(f"{rwhere}: env", "a mapping of NAME: value")
        when_env = {
            variable_name(str(k), f"{rwhere}: when: env"): None if v is None else _env_str(v)
            for k, v in (w["env"] or {}).items()
        }
        r["env"] = _variables(r["env"], f"{rwhere}: env", {})
        out.append(Rule(name=str(name), nodes=w["nodes"], when_env=when_env, **r))
    return tuple(out)


#: ``tiles:`` keys (see :class:`hpc.cluster.Tiles`).
TILES = Table(
    (
        Key("per_gpu", help="devices (tiles) per GPU; divides devices_per_node", **_WHOLE),
        Key(
            "composite_env", "custom", help="variables that make a GPU one device", parse=_variables
        ),
        Key("composite_cpu_bind", help="the CPU list at one rank per GPU"),
        Key("source", help="the page that states it", nullable=False),
    ),
    lax=True,
    model=Tiles,
)


def _tiles(value: Any, label: str, got: dict[str, Any]) -> Tiles:
    """``tiles: {per_gpu: 2, composite_env: {...}, composite_cpu_bind: list:..., source: URL}``
    (see :class:`hpc.cluster.Tiles`): ``devices_per_node`` must be a whole number of GPUs."""
    if not isinstance(value, dict):
        raise expect(label, f"a mapping with {', '.join(TILES.names())}")
    TILES.check_keys(value, label)
    devices = got["devices_per_node"]
    t = TILES.read(value, label)
    if not t["per_gpu"] or not devices or devices % t["per_gpu"]:
        allowed = f"a whole number >= 1 that divides devices_per_node ({devices})"
        raise refuse(f"{label}: per_gpu", value.get("per_gpu"), allowed)
    return Tiles(**t)


def _shell(value: Any, label: str, got: dict[str, Any]) -> str:
    """The script's ``#!`` interpreter: a path and at most one option (``/bin/bash -l``)."""
    shell = str(value or "/bin/bash")
    if not re.match(_SHELL, shell):
        raise refuse(label, shell, "an absolute path and at most one option, e.g. /bin/bash -l")
    return shell


def _device_order(value: Any, label: str, got: dict[str, Any]) -> tuple[int, ...]:
    """``device_order``: a permutation of the node's device indices, by local rank."""
    device, devices = got["device"], got["devices_per_node"]
    if device not in DEVICE_ORDER_VARS:
        raise UserError(
            f"{label}: not available for device {device!r}; "
            f"allowed: with device {', '.join(DEVICE_ORDER_VARS)}"
        )
    if (
        not isinstance(value, list)
        or devices is None
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        or sorted(value) != list(range(devices))
    ):
        allowed = (
            f"each of the devices_per_node indices 0-{(devices or 1) - 1} once, e.g. [3, 2, 1, 0]"
        )
        raise refuse(label, value, allowed)
    return tuple(value)


def _env_prepend(value: Any, label: str, got: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """``env_prepend: {VAR: [dir, ...]}``: each dir is put in front of ``$VAR`` in turn."""
    value = value or {}
    if not isinstance(value, dict):
        raise expect(label, "a mapping of NAME: [directory, ...]")
    out: dict[str, tuple[str, ...]] = {}
    for key in value:
        variable_name(key, label)
        paths = Key(str(key), "strings", lax=True).read(value[key], f"{label}: {key}", got)
        if any(not p or ":" in p or "\n" in p or "\0" in p for p in paths):
            allowed = "directories without ':' or line breaks"
            raise refuse(f"{label}.{key}", list(paths), allowed)
        out[str(key)] = paths
    return out


def _balance(value: Any, label: str, got: dict[str, Any]) -> str:
    if value not in charges.BALANCE_COMMANDS:
        raise refuse(label, value, ", ".join(sorted(charges.BALANCE_COMMANDS)))
    return str(value)


#: ``charge:`` keys (:mod:`hpc.charges`): the site's unit, its page and machine factor.
CHARGE = Table(
    (
        Key("unit", default="node-hours", help="what the site charges in", nullable=False),
        Key("source", default="", help="the page that defines the unit", nullable=False),
        Key("factor", "custom", help="the machine's charge factor (cited)", parse=_factor),
        Key("machine_factor_required", "bool", False, "no charge is shown without it"),
        Key("balance", "custom", help="the site's balance command", parse=_balance),
    ),
    sep=".",
    lax=True,
)


def _charge(value: Any, label: str, got: dict[str, Any]) -> dict[str, Any]:
    """``charge:``: the site's unit, the page defining it and its machine factor (optional)."""
    if not isinstance(value, dict):
        raise expect(label, "a mapping with unit, source, factor")
    CHARGE.check_keys(value, label)
    out = CHARGE.read(value, label)
    if out["balance"] is None:
        del out["balance"]
    return out
