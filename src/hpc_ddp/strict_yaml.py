"""Strict YAML, the one rule set for specs, profiles and configs.

PyYAML's safe loader refuses Python objects, but a spec, a profile or a training config is
still untrusted input in ways it lets through:

- a duplicate key silently keeps the last value (``lr: 1e-3`` twice, the second one a
  leftover): refused here, naming both lines, as yamllint's ``key-duplicates`` rule and
  ruamel.yaml's default do; YAML's own merge (``<<: *base`` then a key) is no duplicate;
- aliases make a file of a few hundred bytes describe 10**9 values ("billion laughs").
  Loading builds shared references and is fast, but anything that walks the result
  (``dataclasses.asdict``, ``str``, a deep copy, rendering) expands it and hangs. The
  composed node graph is measured with aliases expanded before anything is built from it,
  and a document past :data:`MAX_NODES` (or nested past :data:`MAX_DEPTH`, or holding an
  alias to itself) is refused;
- optionally (the login side), YAML 1.1's base-60 integers stay text: ``walltime: 1:00``
  unquoted would be the integer 60, which a person reads as one hour and SLURM and PBS
  read as one minute; kept as ``"1:00"`` the walltime parser can refuse it.

The loader class is built on first use (``hpc render`` must not pay PyYAML's import when
it reads no YAML) and uses libyaml's parser when PyYAML has it.
"""

from __future__ import annotations

import functools
import re
from typing import Any

MAX_NODES = 100_000
"""Largest document, counted with every alias expanded.

A real spec or profile has dozens of values and a real config hundreds. The two sides
used to disagree (100,000 for specs, 1,000,000 for configs); the smaller is kept: it is
still 100x any real file, and it bounds what a crafted file may make a walker build."""

MAX_DEPTH = 200
"""Deepest nesting measured (a real file nests a handful of levels)."""

MERGE_TAG = "tag:yaml.org,2002:merge"
_SEXAGESIMAL = r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"


class Refused(ValueError):
    """A document the rules refuse, as one line without the file's name (the caller puts
    its own label and error type in front)."""


def expanded_size(root: Any, document: str = "document") -> int:
    """Nodes under ``root`` once aliases are expanded, saturating past :data:`MAX_NODES`
    (memoized per node, so linear in the file, not in the expansion)."""
    import yaml

    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any, depth: int) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise Refused(f"line {node.start_mark.line + 1}: an alias refers to itself")
        if depth > MAX_DEPTH:
            raise Refused(f"nested more than {MAX_DEPTH} levels deep; allowed: a plain {document}")
        active.add(key)
        if isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k, depth + 1) + size(v, depth + 1) for k, v in node.value)
        else:
            total = 1
        active.discard(key)
        memo[key] = min(total, MAX_NODES + 1)  # saturate: the exact size past it is moot
        return memo[key]

    return size(root, 0)


@functools.cache
def loader(document: str = "document", base60_as_text: bool = False) -> type:
    """The strict loader class; ``document`` names what a refusal allows ("a plain spec")."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Strict(base):  # type: ignore[valid-type,misc]
        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
            if (
                base60_as_text
                and kind is yaml.ScalarNode
                and implicit[0]
                and re.fullmatch(_SEXAGESIMAL, value)
            ):
                return "tag:yaml.org,2002:str"
            return super().resolve(kind, value, implicit)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue  # `<<: *base` then overriding a key is YAML's own merge
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in first:
                    raise Refused(
                        f"line {line}: duplicate key {key!r} (first at line {first[key]}); "
                        "allowed: each key once per mapping"
                    )
                first[key] = line
            return super().construct_mapping(node, deep=deep)

        def get_single_data(self) -> Any:
            node = self.get_single_node()
            if node is None:
                return None
            if expanded_size(node, document) > MAX_NODES:
                raise Refused(
                    f"more than {MAX_NODES:,} values once aliases are expanded; "
                    f"allowed: a plain {document} (anchors and aliases that stay small)"
                )
            return self.construct_document(node)

    Strict.add_constructor("tag:yaml.org,2002:map", Strict.construct_mapping)
    return Strict


def load(text: str, document: str = "document", *, base60_as_text: bool = False) -> Any:
    """One YAML document parsed strictly.

    Raises :class:`Refused` for what the rules refuse, ``yaml.YAMLError`` for what is not
    YAML and ``RecursionError`` for a parser driven too deep: each side words those.
    """
    import yaml

    try:
        return yaml.load(text, Loader=loader(document, base60_as_text))
    except Refused:
        raise
    except ValueError as exc:  # a constructor's: an integer past Python's 4300 digits
        reason = str(exc).split(";")[0]
        raise Refused(
            f"holds a value that cannot be read ({reason}); allowed: integers of up to "
            "4300 digits and real dates"
        ) from None
