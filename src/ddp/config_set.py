"""Dotted assignments (``--set optim.lr=1e-4``, recipe flags) applied to a built config.

The assignments are set on the config's own sections, not on a dict copy of the whole
config that is then built again: each touched key is converted to its type once and each
touched section checked once, after all assignments (so ``--set scaling.by=batch
scaling.base_batch_size=64`` passes, as the second fixes what the first alone would not).
Untouched sections were checked when the config was built and are not checked again.

The walk reads a section as the mapping of its keys, in declaration order, so every
message is the one a dict of the whole config would give: an unknown key names the
nearest one, ``phases.5: no such list element``, ``precision is a value, not a section``.
A value set to a mapping or list stays that raw value until the end (a later assignment
walks into it as into the mapping it is), then is built and checked with its key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from ddp.config_check import _choices, _coerce, _unknown, _validate
from ddp.config_schema import hints
from ddp.errors import ConfigError

_FREE = ("model", "recipe")
"""Top-level sections whose keys the recipe checks (ddp.config.check_free_section)."""

#: A step from the config's root: a field name or a list index.
_Step = str | int


@dataclasses.dataclass
class _Touched:
    """One key set on a section: where it sits (to order and re-find it) and its name."""

    obj: Any  # the section (a dataclass instance)
    name: str  # the field set, or the one holding the list or mapping set into
    steps: tuple[_Step, ...]  # root -> obj, to find it again
    order: tuple[float, ...]  # root -> field, as positions: the order a build meets it
    where: str  # the section's dotted name, for messages


def apply(config: Any, items: Iterable[tuple[str, Any]]) -> None:
    """Set each ``(dotted key, value)`` on ``config`` in place, then convert and check what
    was touched (see the module docstring). ``config`` is the caller's own copy."""
    touched: dict[tuple[int, str], _Touched] = {}
    for key, value in items:
        entry = _assign(config, key, value)
        touched.setdefault((id(entry.obj), entry.name), entry)
    _settle(config, touched)


def _keys(node: Any) -> list[str]:
    if dataclasses.is_dataclass(node):
        return [f.name for f in dataclasses.fields(node)]
    return list(node)


def _assign(root: Any, key: str, value: Any) -> _Touched:
    """Walk ``key`` from ``root``, set ``value`` at its end and say which section field
    changed: the key itself, or the section's list or mapping field it was set inside."""
    parts = key.split(".")
    node: Any = root
    steps: tuple[_Step, ...] = ()  # root -> node
    order: tuple[float, ...] = ()
    owner: _Touched | None = None  # the section field whose list or mapping we are inside
    child: Any
    step: _Step

    def field_of(section: Any, name: str, depth: int) -> _Touched:
        index = float(_keys(section).index(name))
        return _Touched(section, name, steps, order + (index,), ".".join(parts[:depth]))

    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{here}: no such list element")
            child, step, order = node[int(part)], int(part), order + (float(part),)
        elif part not in _keys(node):
            _unknown(".".join(parts[:i]), part, _keys(node))
        elif dataclasses.is_dataclass(node):
            owner = field_of(node, part, i)
            child, step, order = getattr(node, part), part, owner.order
            if child is None:  # an unset key walked into: a mapping from here on
                child = {}
                setattr(node, part, child)
        else:
            child, step = node[part], part
            if child is None:
                child = node[part] = {}
        if dataclasses.is_dataclass(child):
            owner = None  # a section of its own: what is set in it is its own field
        elif not isinstance(child, dict | list):
            raise ConfigError(f"{here} is a value, not a section")
        node, steps = child, steps + (step,)
    last = parts[-1]
    if dataclasses.is_dataclass(node):
        if last not in _keys(node):
            _unknown(".".join(parts[:-1]), last, _keys(node))
        setattr(node, last, value)
        return field_of(node, last, len(parts) - 1)
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"{key}: no such list element")
        node[int(last)] = value
    else:
        if last not in node and parts[0] not in _FREE:
            _unknown(".".join(parts[:-1]), last, list(node))
        node[last] = value
    assert owner is not None  # a list or mapping is always some section's field
    return owner


def _find(root: Any, steps: tuple[_Step, ...]) -> Any:
    """The object at ``steps`` from ``root`` now (None if a later assignment replaced it)."""
    node = root
    for step in steps:
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                return None
            node = node[step]
        elif dataclasses.is_dataclass(node):
            node = getattr(node, step)
        else:
            return None
    return node


def _settle(root: Any, touched: dict[tuple[int, str], _Touched]) -> None:
    """Convert each touched key to its type, then check each touched section once, in the
    order a build of the whole config meets them (so the first bad value named is the one
    a build would name), and rerun a section's ``__post_init__`` (``checkpoint.dir`` under
    ``$HPC_RUN_DIR``) as its construction would have."""
    live = [t for t in touched.values() if _find(root, t.steps) is t.obj]  # not replaced
    sections: dict[int, _Touched] = {}
    events: list[tuple[tuple[float, ...], int, _Touched]] = []
    for t in live:
        events.append((t.order, 0, t))
        sections.setdefault(id(t.obj), t)
    for t in sections.values():
        events.append((t.order[:-1] + (float("inf"),), 1, t))
    for _, kind, t in sorted(events, key=lambda e: (e[0], e[1])):
        obj = t.obj
        if kind == 0:
            f = next(f for f in dataclasses.fields(obj) if f.name == t.name)
            value = getattr(obj, t.name)
            path = f"{t.where}.{t.name}" if t.where else t.name
            setattr(obj, t.name, _coerce(value, hints(type(obj))[t.name], path, _choices(f)))
            continue
        post_init = getattr(obj, "__post_init__", None)
        if post_init is not None:
            post_init()
        _validate(obj, t.where)
