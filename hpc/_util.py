"""Small helpers shared by the login-node modules: YAML loading, walltimes, names.

Kept free of heavy imports so that ``hpc render`` starts fast.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO, Literal, overload

from hpc.errors import UserError

_WALLTIME = r"^(\d{1,4}):([0-5]\d):([0-5]\d)\Z"  # compiled on first use (re's cache)
# Values that end up inside #PBS/#SBATCH directives: schedulers parse those lines
# themselves, so quoting does not help there; restrict them to a plain character set.
_DIRECTIVE_SAFE = r"^[A-Za-z0-9_.:+,=@/%-]+\Z"  # compiled on first use (re's cache)
_VARIABLE = r"^[A-Za-z_][A-Za-z0-9_]*\Z"  # compiled on first use (re's cache)


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


MAX_YAML_NODES = 100_000
"""Largest spec or profile, counted with aliases expanded (a real one has dozens)."""

_SEXAGESIMAL = r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"


def _strict_loader() -> type:
    """A safe YAML loader that refuses what silently changes a job (built on first use).

    - ``walltime: 1:00`` unquoted is YAML 1.1's base-60 integer 60; here it stays the
      text ``1:00`` so that walltime parsing can refuse it (it reads as one hour to a
      person, one minute to SLURM and PBS);
    - a duplicate key would silently keep the last value: refused naming both lines;
    - aliases can make a small file describe billions of values ("billion laughs"):
      a document past :data:`MAX_YAML_NODES` once expanded is refused before it is built.
    """
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Strict(base):  # type: ignore[valid-type,misc]
        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
            if kind is yaml.ScalarNode and implicit[0] and re.fullmatch(_SEXAGESIMAL, value):
                return "tag:yaml.org,2002:str"
            return super().resolve(kind, value, implicit)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                    key_node, yaml.ScalarNode
                ):
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in first:
                    raise UserError(
                        f"line {line}: duplicate key {key!r} (first at line "
                        f"{first[key]}); allowed: each key once"
                    )
                first[key] = line
            return super().construct_mapping(node, deep=deep)

        def get_single_data(self) -> Any:
            node = self.get_single_node()
            if node is None:
                return None
            if _expanded_size(node) > MAX_YAML_NODES:
                raise UserError(
                    f"more than {MAX_YAML_NODES:,} values once aliases are "
                    "expanded; allowed: a plain spec"
                )
            return self.construct_document(node)

    Strict.add_constructor("tag:yaml.org,2002:map", Strict.construct_mapping)
    return Strict


def _expanded_size(root: Any) -> int:
    """Nodes once aliases are expanded, saturating past the limit (memoized: linear)."""
    import yaml

    memo: dict[int, int] = {}

    def size(node: Any, depth: int = 0) -> int:
        if id(node) in memo:
            return memo[id(node)]
        if depth > 200:
            raise UserError("nested more than 200 levels deep; allowed: a plain spec")
        memo[id(node)] = MAX_YAML_NODES + 1  # an alias to itself counts as too big
        if isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(c, depth + 1) for c in node.value)
        elif isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k, depth + 1) + size(v, depth + 1) for k, v in node.value)
        else:
            total = 1
        memo[id(node)] = min(total, MAX_YAML_NODES + 1)
        return memo[id(node)]

    return size(root)


MAX_YAML_BYTES = 16 * 1024 * 1024
"""Largest spec or profile file read (a real one is a few kilobytes)."""


def load_yaml(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML mapping strictly (see :func:`_strict_loader`); every problem one line."""
    import yaml

    # a spec or a project's profile may come with a cloned folder: a pipe there would
    # block, a huge file would be read whole (read_regular refuses both in one line)
    data = read_regular(path, what, MAX_YAML_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{what}: {str(path)!r} is not UTF-8 text (byte {exc.start}); allowed: a YAML file"
        ) from None
    try:
        data = yaml.load(text, Loader=_strict_loader())
    except UserError as exc:
        raise UserError(f"{what}: {str(path)!r} {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise UserError(f"{what}: {str(path)!r}{where}: {problem}") from None
    except RecursionError:
        raise UserError(f"{what}: {str(path)!r} is nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"{what}: {str(path)!r} holds a {type(data).__name__}; allowed: a mapping of keys"
        )
    return data


MAX_RUN_FILE = 64 * 1024 * 1024
"""Largest run-directory file read whole (``run.json``, ``sweep.json``, a log tail is
read with its own bound): a real one is kilobytes; a bigger one is damage or a trap."""


@overload
def open_regular(path: Path, what: str, *, missing_ok: Literal[False] = False) -> BinaryIO: ...
@overload
def open_regular(path: Path, what: str, *, missing_ok: bool) -> BinaryIO | None: ...
def open_regular(path: Path, what: str, *, missing_ok: bool = False) -> BinaryIO | None:
    """``path`` opened for reading in binary, only if it is a regular file; never blocks.

    Readers of run directories and stores take untrusted paths: a named pipe there
    would block ``open`` forever, a device or ``/dev/zero`` would never end. The file is
    opened ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a writer), then
    ``fstat`` on the open descriptor (no race with a swap) must say regular file. For a
    reader that streams (a long ``metrics.jsonl``, a log being followed), which bounds
    what it reads; :func:`read_regular` reads whole. Every refusal is one
    :class:`UserError` line; a missing file is None with ``missing_ok`` (a log not
    written yet).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        if missing_ok:
            return None
        raise UserError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None
    except IsADirectoryError:
        raise UserError(f"{what}: {str(path)!r} is a directory; allowed: a regular file") from None
    except OSError as exc:
        raise UserError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(info.st_mode)
                else ("a named pipe" if stat.S_ISFIFO(info.st_mode) else "not a regular file")
            )
            raise UserError(f"{what}: {str(path)!r} is {kind}; allowed: a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, what: str, limit: int = MAX_RUN_FILE) -> bytes:
    """The bytes of a regular file (:func:`open_regular`), never more than ``limit``."""
    fh = open_regular(path, what)
    assert fh is not None  # missing_ok is False: a missing file raised
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise UserError(f"{what}: {str(path)!r} is {size:,} bytes; allowed: at most {limit:,}")
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise UserError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None
        if len(data) > limit:
            raise UserError(
                f"{what}: {str(path)!r} grew past {limit:,} bytes while "
                "being read; allowed: a finished file"
            )
        return data


def write_atomic(path: Path, text: str | bytes, what: str = "--output") -> None:
    """Write ``text`` (or bytes) to ``path`` all or nothing, never through a planted link.

    The temporary file comes from ``mkstemp`` in the target folder (``O_EXCL``, an
    unpredictable name), so a symlink someone placed at ``PATH.tmp`` is never followed;
    ``os.replace`` then swaps it in, with the mode a new file gets (0644 less the umask,
    as every other file of a run directory). Only a regular file is ever replaced: a
    device, FIFO or socket at ``path`` (``-o /dev/null``, which as root ``os.replace``
    would turn into a plain file) is refused. Errors are one line and leave nothing behind.
    """
    import tempfile

    if path.is_dir():
        raise UserError(f"{what}: {str(path)!r} is a directory; allowed: a file path")
    try:
        mode = path.stat().st_mode
    except OSError:  # nothing there yet (or a dangling link, replaced like a file)
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise UserError(
            f"{what}: {str(path)!r} exists and is not a regular file (a device, "
            "FIFO or socket); allowed: a new or regular file path"
        )
    if not path.parent.is_dir():
        raise UserError(
            f"{what}: folder {str(path.parent)!r} does not exist; allowed: an existing folder"
        )
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise UserError(f"{what}: cannot write in {str(path.parent)!r}: {exc.strerror}") from None
    try:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UserError(f"{what}: cannot write {str(path)!r}: {exc.strerror}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def parse_walltime(value: Any, field: str = "walltime") -> int:
    """Seconds from 'HH:MM:SS' (hours may exceed 24).

    An int is seconds (the Python API's unit). An unquoted ``1:00`` in a spec reaches
    here as text, not as YAML 1.1's base-60 integer 60 (see :func:`load_yaml`), and the
    pattern refuses it: a person means one hour, SLURM and PBS read one minute.
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


def directive_line(value: Any, field: str) -> str:
    """Check a whole directive or comment line (a profile's ``directives``, a queue's
    ``notes``, a path inside a directive): one line of printable text.

    Why: schedulers read ``#SBATCH``/``#PBS`` lines up to the line break, so a break in a
    value is a directive of its own; other control characters are no text a scheduler or
    a reader expects, and Unicode's line separators break lines for editors and Python's
    ``splitlines``. A tab is a blank and stays.
    """
    import unicodedata

    text = str(value)
    for c in text:
        if c != "\t" and unicodedata.category(c) in ("Cc", "Zl", "Zp"):
            raise UserError(f"{field}: {text!r} holds {c!r}; allowed: one line of printable text")
    return text


def variable_name(value: Any, field: str) -> str:
    """Check an environment variable's name (it is written unquoted: ``export NAME=...``)."""
    text = str(value)
    if not re.match(_VARIABLE, text):
        raise UserError(
            f"{field}: {text!r} is not a variable name; allowed: letters, digits "
            "and _, not starting with a digit"
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
