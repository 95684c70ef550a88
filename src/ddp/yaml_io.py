"""Strict YAML for configs: safe types only, duplicate keys refused, alias expansion bounded.

PyYAML's ``safe_load`` already refuses Python objects, but a config is still untrusted
input in two ways it lets through:

- a duplicate key silently keeps the last value (``lr: 1e-3`` twice, the second one a
  leftover) -- refused here, naming both lines, as yamllint's ``key-duplicates`` rule and
  ruamel.yaml's default do;
- aliases make a file of a few hundred bytes describe 10**9 values ("billion laughs").
  Loading builds shared references and is fast, but anything that walks the result
  (``dataclasses.asdict``, ``str``, a deep copy) expands it and hangs. The composed node
  graph is measured with aliases expanded before anything is built from it, and a document
  past :data:`MAX_NODES` is refused.

Errors are :class:`ddp.errors.ConfigError` with one line naming the file and the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ddp.errors import ConfigError

MAX_NODES = 1_000_000
"""Largest document, counted with every alias expanded (a real config has hundreds)."""

_MERGE_TAG = "tag:yaml.org,2002:merge"


def _expanded_size(root: yaml.Node) -> int:
    """Number of nodes once aliases are expanded (shared nodes counted once per use)."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise ConfigError(f"line {node.start_mark.line + 1}: an alias refers to itself")
        active.add(key)
        if isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        else:
            total = 1
        active.discard(key)
        memo[key] = min(total, MAX_NODES + 1)  # saturate: the exact size past it is moot
        return memo[key]

    return size(root)


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue  # `<<: *base` then overriding a key is YAML's own merge, not a dup
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first:
                raise ConfigError(
                    f"line {line}: duplicate key {key!r} (first at line {first[key]}); "
                    "allowed: each key once per mapping"
                )
            first[key] = line
        return super().construct_mapping(node, deep=deep)

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_NODES:
            raise ConfigError(
                f"more than {MAX_NODES:,} values once aliases are expanded; "
                "allowed: a plain config (anchors and aliases that stay small)"
            )
        return self.construct_document(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping
)


def loads(text: str, source: str = "<string>") -> Any:
    """Parse one YAML document strictly; every problem is one ConfigError line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}:{where} not valid YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be a config") from None


def load_file(path: str | Path, what: str = "config file") -> Any:
    """Read and parse a YAML file; unreadable, non-UTF-8 or a directory is one line."""
    p = Path(path)
    label = f"{what} {str(p)!r}"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{label} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{label} is a directory; allowed: a YAML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{label} is not UTF-8 text (byte {exc.start}); allowed: a YAML file"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read: {exc.strerror}") from None
    return loads(text, label)
