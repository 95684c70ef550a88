"""Small helpers shared by the login-node modules: YAML loading, walltimes, names.

Kept free of heavy imports so that ``hpc render`` starts fast.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from hpc.errors import UserError

_WALLTIME = r"^(\d{1,4}):([0-5]\d):([0-5]\d)\Z"  # compiled on first use (re's cache)
# Values that end up inside #PBS/#SBATCH directives: schedulers parse those lines
# themselves, so quoting does not help there; restrict them to a plain character set.
_DIRECTIVE_SAFE = r"^[A-Za-z0-9_.:+,=@/%-]+\Z"  # compiled on first use (re's cache)


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """Return ' (did you mean X?)' for the nearest choice, or '' when none is close."""
    import difflib

    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]}?)" if close else ""


def check_keys(data: dict[str, Any], allowed: Iterable[str], where: str) -> None:
    """Name every unknown key with the nearest valid one, so typos never pass silently."""
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            raise UserError(
                f"{where}: unknown key {key!r}{did_you_mean(key, allowed)}; "
                f"allowed: {', '.join(sorted(allowed))}"
            )


class Record:
    """A plain attribute record with keyword construction and field equality.

    Used instead of dataclasses because ``hpc render`` is timed against peers and
    each ``@dataclass`` costs about a millisecond at import.
    """

    _defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(self._defaults)
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown fields {sorted(unknown)}")
        for name, default in self._defaults.items():
            if name in kwargs:
                value = kwargs[name]
            elif default is REQUIRED:
                raise TypeError(f"{type(self).__name__}: missing field {name!r}")
            else:
                value = type(default)(default) if isinstance(default, (list, dict)) else default
            setattr(self, name, value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in self._defaults
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._defaults)
        return f"{type(self).__name__}({inner})"


REQUIRED: Any = object()


def cache_dir() -> Path | None:
    """Where parsed YAML and compiled templates are cached; None if disabled.

    ``$HPC_DDP_CACHE`` (or ``$XDG_CACHE_HOME/hpc-ddp``, ``~/.cache/hpc-ddp``);
    ``HPC_DDP_CACHE=off`` disables it. Entries are keyed by content or file stat,
    so a stale entry is never used.
    """
    env = os.environ.get("HPC_DDP_CACHE")
    if env == "off":
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpc-ddp"


def _plain(value: Any) -> bool:
    """True when JSON gives ``value`` back unchanged (str keys, JSON scalars)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def load_yaml(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML mapping, through a JSON cache keyed by the file's stat.

    PyYAML alone costs more at import than everything else ``hpc render`` does
    besides Jinja2, so a file parsed once is read back as JSON (stdlib, cheap).
    """
    try:
        st = path.stat()
        key = f"{os.path.realpath(path)}|{st.st_mtime_ns}|{st.st_size}|{st.st_ino}|1"
    except OSError as exc:
        raise UserError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None
    cache = cache_dir()
    entry = None
    if cache is not None:
        import hashlib

        entry = cache / "yaml" / (hashlib.sha1(key.encode()).hexdigest() + ".json")
        try:
            return json.loads(entry.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
    data = _parse_yaml(path, what)
    if entry is not None and _plain(data):
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data), encoding="utf-8")
            os.replace(tmp, entry)
        except OSError:
            pass
    return data


def _parse_yaml(path: Path, what: str) -> dict[str, Any]:
    """Parse a YAML mapping (the C loader when present: several times faster)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 - safe loader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise UserError(f"{what}: {str(path)!r}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"{what}: {str(path)!r} holds a {type(data).__name__}; allowed: a mapping of keys"
        )
    return data


def parse_walltime(value: Any, field: str = "walltime") -> int:
    """Seconds from 'HH:MM:SS' (hours may exceed 24).

    An int is taken as seconds: YAML 1.1 reads an unquoted ``1:30:00`` as the
    sexagesimal number 5400, which is exactly its length in seconds.
    """
    if isinstance(value, bool):
        raise UserError(f"{field}: {value!r} is not a walltime; allowed: HH:MM:SS, e.g. 01:30:00")
    if isinstance(value, int):
        if value <= 0:
            raise UserError(f"{field}: {value!r} must be positive; allowed: HH:MM:SS")
        return value
    match = re.match(_WALLTIME, str(value).strip())
    if not match:
        raise UserError(
            f"{field}: {str(value)!r} is not a walltime; allowed: HH:MM:SS, e.g. 01:30:00"
        )
    h, m, s = (int(g) for g in match.groups())
    total = h * 3600 + m * 60 + s
    if total == 0:
        raise UserError(f"{field}: {str(value)!r} is zero; allowed: a positive HH:MM:SS")
    return total


def format_walltime(seconds: int) -> str:
    """HH:MM:SS with at least two hour digits (PBS and SLURM both accept this)."""
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h:02d}:{m:02d}:{s:02d}"


def directive_value(value: Any, field: str) -> str:
    """Check a value bound for a scheduler directive against a plain character set."""
    text = str(value)
    if not re.match(_DIRECTIVE_SAFE, text):
        raise UserError(
            f"{field}: {text!r} has characters a scheduler directive cannot carry; "
            "allowed: letters, digits and _ . : + , = @ / % -"
        )
    return text


def parse_range(value: Any, field: str) -> tuple[int, int]:
    """'1-2' or 3 -> (min, max) node counts."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    match = re.match(r"^\s*(\d+)\s*-\s*(\d+)\s*\Z", str(value))
    if not match or int(match.group(1)) > int(match.group(2)) or int(match.group(1)) < 1:
        raise UserError(f"{field}: {value!r} is not a node range; allowed: MIN-MAX, e.g. 1-2")
    return int(match.group(1)), int(match.group(2))


def job_name(value: str) -> str:
    """Reduce a name to what PBS and SLURM both accept: [A-Za-z0-9_.-], letter first."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(value)).strip("_.-")[:64]
    if not name:
        return "job"
    if not name[0].isalpha():
        name = "j" + name[:63]
    return name
