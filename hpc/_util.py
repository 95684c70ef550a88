"""Small helpers shared by the login-node modules: YAML loading, walltimes, names.

Kept free of heavy imports so that ``hpc render`` starts fast.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, Literal, overload

from hpc.errors import UserError

# The strict YAML rules (duplicate keys, alias bombs, base-60 walltimes) are the ones the
# compute side's configs use too: one definition, in hpc_ddp.strict_yaml (PyYAML imported
# on use). Re-exported: the login side's name for the limit.
from hpc_ddp.strict_yaml import MAX_NODES as MAX_YAML_NODES  # noqa: F401

_WALLTIME = r"^([0-9]{1,4}):([0-5][0-9]):([0-5][0-9])\Z"  # compiled on first use (re's cache)
#: The largest count a flag or spec takes (nodes, ranks, GPUs, cores, batch, steps): far
#: past any machine, well inside the 32-bit fields schedulers keep counts in.
MAX_COUNT = 10_000_000
#: The longest walltime, the one HH:MM:SS can say (hours up to 9999): an int of seconds
#: (the Python API's unit) past it would render a time no scheduler reads as meant.
MAX_WALLTIME_S = 9999 * 3600 + 59 * 60 + 59
# Values that end up inside #PBS/#SBATCH directives: schedulers parse those lines
# themselves, so quoting does not help there; restrict them to a plain character set.
_DIRECTIVE_SAFE = r"^[A-Za-z0-9_.:+,=@/%-]+\Z"  # compiled on first use (re's cache)
#: A name: a shell variable's (written unquoted in ``export NAME=...``), a config key's part.
NAME = r"[A-Za-z_][A-Za-z0-9_]*"  # the one spelling; anchored or embedded where used
_VARIABLE = rf"^{NAME}\Z"  # compiled on first use (re's cache)


def json_number(value: Any) -> float | None:
    """A JSON number of an untrusted file as float (inf/NaN kept, an integer past a float's
    range as inf); anything else (bools, text) is None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # a 400-digit integer
        return math.inf if value > 0 else -math.inf


def printable(text: str) -> str:
    """``text`` as a terminal or a plot can show it: each character that is not printable
    as an escape. A run's files and folder names are anyone's text: a control character
    would reach the terminal, and a lone surrogate (a name's bytes that are not UTF-8, as
    Python keeps them, or a ``\\ud800`` in JSON) stops a UTF-8 write with a traceback."""
    if text.isprintable():
        return text
    out = []
    for c in text:
        if c.isprintable():
            out.append(c)
        elif "\udc80" <= c <= "\udcff":  # a byte that was not UTF-8, as the byte
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        else:
            out.append(c.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def plot_text(text: str) -> str:
    """``text`` as a plot should draw it, as written: :func:`printable`, with ``$`` kept
    from matplotlib's math (``$\\foo$`` is an error there) and a leading ``_`` from its
    rule that leaves such a label out of a legend."""
    text = printable(text).replace("$", r"\$")
    return f" {text}" if text.startswith("_") else text


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


MAX_YAML_BYTES = 16 * 1024 * 1024
"""Largest spec or profile file read (a real one is a few kilobytes)."""


def load_yaml(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML mapping strictly (:mod:`hpc_ddp.strict_yaml`, base-60 numbers kept as text
    for :func:`parse_walltime` to refuse); every problem one line."""
    import yaml

    from hpc_ddp import strict_yaml

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
        data = strict_yaml.load(text, "spec", base60_as_text=True)
    except strict_yaml.Refused as exc:
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

    The rule is both sides' one (:func:`hpc_ddp.files.open_regular`: a named pipe
    never blocks, a device or folder is refused on the open descriptor); here each
    refusal is one :class:`UserError` line naming ``what``, and a missing file is None
    with ``missing_ok`` (a log not written yet). For a reader that streams (a long
    ``metrics.jsonl``, a log being followed), which bounds what it reads;
    :func:`read_regular` reads whole.
    """
    from hpc_ddp.files import Missing, NotRegular
    from hpc_ddp.files import open_regular as shared_open

    try:
        fd, _info = shared_open(path)
    except NotRegular as exc:
        if missing_ok and isinstance(exc, Missing):
            return None
        raise UserError(f"{what}: {str(path)!r} {exc}") from None
    return os.fdopen(fd, "rb")


def check_replaceable(
    path: Path, what: str, owner: tuple[str, Callable[[bytes], bool]] | None = None
) -> None:
    """:func:`write_atomic`'s refusals, before anything is written: a folder, a device
    or FIFO, a missing folder, or (with ``owner``) a file that is not empty and that
    ``owner``'s test does not recognise. Callers that write several files check them all
    first, so a refusal leaves every one as it was."""
    from hpc_ddp.files import NotRegular, open_regular

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
    if mode is None or owner is None:
        return
    writer, recognises = owner
    try:
        fd, _ = open_regular(path)
        try:
            head = os.read(fd, OWNER_HEAD)
        finally:
            os.close(fd)
    except (NotRegular, OSError) as exc:
        raise UserError(f"{what}: {str(path)!r} {exc}; allowed: a new path") from None
    if head and not recognises(head):
        raise UserError(
            f"{what}: {str(path)!r} exists and is not {writer}; allowed: a new path "
            "(it is left as it is; remove it first to replace it)"
        )


def read_regular(path: Path, what: str, limit: int = MAX_RUN_FILE) -> bytes:
    """The bytes of a regular file (:func:`hpc_ddp.files.read_regular`), never more than
    ``limit``; a refusal is one :class:`UserError` line naming ``what``."""
    from hpc_ddp.files import NotRegular
    from hpc_ddp.files import read_regular as shared_read

    try:
        return shared_read(path, limit)[0]
    except NotRegular as exc:
        raise UserError(f"{what}: {str(path)!r} {exc}") from None


#: How much of an existing file :func:`write_atomic` reads to recognise what wrote it.
OWNER_HEAD = 64 * 1024


def write_atomic(
    path: Path,
    text: str | bytes,
    what: str = "--output",
    owner: tuple[str, Callable[[bytes], bool]] | None = None,
) -> None:
    """Write ``text`` (or bytes) to ``path`` all or nothing, never through a planted link.

    The mechanism is both sides' one atomic write (:func:`hpc_ddp.files.write_atomic`:
    ``mkstemp`` in the target folder, so a symlink someone placed there is never followed,
    then ``os.replace``, with the mode a new file gets, 0644 less the umask). What this adds
    is the login side's refusals: only a regular file is ever replaced (a device, FIFO or
    socket at ``path``, ``-o /dev/null``, which as root ``os.replace`` would turn into a
    plain file, is refused), and every error is one line that leaves nothing behind.

    ``owner``: (what wrote the file, a test of its first :data:`OWNER_HEAD` bytes). A
    user-named output then replaces only an empty file or one that test recognises as
    the project's own (``hpc render -o spec.yaml`` would replace the spec, ``hpc report
    -o RUN/run.json`` the run's record): ``--force``'s rule, for outputs.
    """
    from hpc_ddp.files import AtomicFile

    check_replaceable(path, what, owner)
    try:
        staged = AtomicFile(path)
    except OSError as exc:
        raise UserError(f"{what}: cannot write in {str(path.parent)!r}: {exc.strerror}") from None
    try:
        try:
            staged.fh.write(text if isinstance(text, bytes) else text.encode("utf-8"))
        except BaseException:
            staged.discard()
            raise
        staged.commit()
    except OSError as exc:
        raise UserError(f"{what}: cannot write {str(path)!r}: {exc.strerror}") from None


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
        if value > MAX_WALLTIME_S:
            shown = str(value) if value < 10**30 else f"a {len(str(value))}-digit number"
            raise UserError(
                f"{field}: {shown} seconds; allowed: at most {MAX_WALLTIME_S} (9999:59:59)"
            )
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
