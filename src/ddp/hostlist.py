"""Host lists as schedulers write them: SLURM's compressed node lists, node files.

Kept apart from launcher detection (``ddp.env``) because both the master address
and the rank layout are read from the same lists, and because the parsing rules
are what `scontrol show hostnames` does, which is worth testing on its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddp.errors import ConfigError

#: Brackets that hold only digits, ranges and commas (SLURM's hostlist grammar).
_BRACKET_BODY = re.compile(r"\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*")


def _expand_item(item: str, whole: str) -> list[str]:
    """Expand one host expression with any number of bracket groups (cartesian product)."""
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        if "[" in item or "]" in item:
            raise ConfigError(f"node list: unbalanced brackets in {whole!r}")
        return [item]
    head, body, tail = item[: m.start()], m.group(1), item[m.end() :]
    if not _BRACKET_BODY.fullmatch(body):
        raise ConfigError(
            f"node list: bad bracket [{body}] in {whole!r}; allowed: numbers and ranges "
            "such as nid[001-004,010]"
        )
    values: list[str] = []
    for part in body.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = (p.strip() for p in part.split("-", 1))
            if int(lo) > int(hi):
                raise ConfigError(f"node list: bad range {part!r} in {whole!r}")
            width = len(lo)
            values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            values.append(part)
    return [head + v + rest for v in values for rest in _expand_item(tail, whole)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM compressed host list, e.g. ``nid[001002-001004,001010],login1``.

    As ``scontrol show hostnames`` does: zero padding is kept (``nid[08-10]`` ->
    nid08, nid09, nid10), several bracket groups in one name expand as a product,
    commas inside brackets do not split hosts, and hosts may be separated by commas
    or white space. Empty or non-numeric brackets (``n[]``, ``n[a-b]``) are refused.
    """
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list: unbalanced brackets in {nodelist!r}")
        elif depth == 0 and (ch == "," or ch.isspace()):
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"node list: unbalanced brackets in {nodelist!r}")
    items.append(nodelist[start:])
    hosts: list[str] = []
    for item in items:
        if item:
            hosts.extend(_expand_item(item, nodelist))
    return hosts


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE (``2(x3),1``) into one count per node."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"SLURM_TASKS_PER_NODE: cannot parse {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def read_hosts(path: str, var: str) -> list[str]:
    """The non-empty lines of a node file named by ``var`` (one line per slot or node)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return [line.strip() for line in fh if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or "not a text file"
        raise ConfigError(f"{var}={path!r} cannot be read: {why}") from None


def job_hosts(env: Mapping[str, str]) -> list[str]:
    """The job's hosts in order, one entry per line/slot (duplicates kept).

    PBS_NODEFILE first, then LSF's rank file (whose first line is the launch node,
    which runs no rank), then SLURM's node list of the step, else of the job.
    """
    if env.get("PBS_NODEFILE"):
        return read_hosts(env["PBS_NODEFILE"], "PBS_NODEFILE")
    if env.get("LSB_DJOB_RANKFILE"):
        return read_hosts(env["LSB_DJOB_RANKFILE"], "LSB_DJOB_RANKFILE")[1:]
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return expand_nodelist(env[name])
    return []


def unique(hosts: list[str]) -> list[str]:
    """Hosts in first-seen order without repeats (node files repeat a host per slot)."""
    return list(dict.fromkeys(hosts))


def short(host: str) -> str:
    """A host's short name, as node files and `hostname -s` may disagree on the domain.

    An IPv4 address (LSF rank files may hold them) is kept whole.
    """
    if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", host):
        return host
    return host.split(".")[0]
