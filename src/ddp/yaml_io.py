"""Strict YAML for configs: the rules of :mod:`hpc_ddp.strict_yaml`, worded as ConfigError.

The rules (safe types only, duplicate keys refused naming both lines, alias expansion
bounded before anything is built) are written once, in :mod:`hpc_ddp.strict_yaml`, for the
login side's specs and profiles and this side's configs alike. Here they become
:class:`ddp.errors.ConfigError` lines naming the file (or ``--set KEY``) and the line.
Unlike a spec, a config keeps YAML 1.1's base-60 integers as PyYAML reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ddp.errors import ConfigError
from hpc_ddp import strict_yaml
from hpc_ddp.strict_yaml import MAX_NODES  # noqa: F401  (re-exported: ddp's name for it)


def loads(text: str, source: str = "<string>") -> Any:
    """Parse one YAML document strictly; every problem is one ConfigError line."""
    try:
        return strict_yaml.load(text, "config")
    except strict_yaml.Refused as exc:
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
