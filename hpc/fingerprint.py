"""What changed between two submissions of a run: ``hpc report``'s environment section.

The job writes ``RUN/env-JOBID.json`` at start (``ddp.fingerprint``: packages, device
stacks, modules, git commit and diff, communication variables, per-node hashes). Here
the run's records are read (as untrusted files: regular, bounded, JSON objects) and the
latest two compared: packages added, removed or changed, versions, modules, the commit
and its uncommitted diff, and the variables that are not this allocation's own
(``SLURM_*``/``PBS_*`` ids and node lists differ every time and say nothing).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from hpc._util import printable, read_regular
from hpc.errors import UserError

MAX_FILE = 16 * 1024 * 1024
_ALLOCATION = ("SLURM_", "PBS_", "PALS_", "HPC_")  # ddp.fingerprint.ALLOCATION's default


def load(run_dir: Path) -> list[dict[str, Any]]:
    """The run's fingerprints, oldest first; a file that is not one is skipped."""
    out = []
    for path in sorted(Path(run_dir).glob("env-*.json")):
        try:
            data = json.loads(read_regular(path, "report", MAX_FILE))
        except (UserError, ValueError, RecursionError):
            continue
        if isinstance(data, dict) and isinstance(data.get("software"), dict):
            out.append(data)
    return sorted(out, key=lambda d: d["time"] if isinstance(d.get("time"), int | float) else 0)


def _flat(prefix: str, value: Any) -> dict[str, str]:
    """A nested record as ``{"a.b": "text"}`` (lists joined), for a line-per-change diff."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, sub in value.items():
            out.update(_flat(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    return {prefix: _words(value)}


def _words(value: Any) -> str:
    """A record's value as text: a list joined, anything else as ``str`` gives it."""
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return "" if value is None else str(value)


def _compare(old: dict[str, str], new: dict[str, str], what: str) -> list[str]:
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if a is None:
            lines.append(f"{what} {key}: + {b}")
        elif b is None:
            lines.append(f"{what} {key}: - {a}")
        else:
            lines.append(f"{what} {key}: {a} -> {b}")
    return lines


def _git(rec: dict[str, Any]) -> dict[str, str]:
    git = rec.get("git")
    if not isinstance(git, dict):
        git = {}
    diff = str(git.get("diff") or "")
    digest = hashlib.sha256(diff.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return {
        "commit": str(git.get("commit") or ""),
        "uncommitted diff": digest if diff else "none",
        "untracked": _words(git.get("untracked")),
    }


def _env(rec: dict[str, Any]) -> dict[str, str]:
    env = rec.get("env")
    if not isinstance(env, dict):
        env = {}
    given = rec.get("allocation_prefixes", _ALLOCATION)
    skip = tuple(p for p in given if isinstance(p, str)) if isinstance(given, list) else ()
    return {str(k): str(v) for k, v in env.items() if not str(k).startswith(skip or _ALLOCATION)}


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per difference of ``new`` from ``old`` (empty: the same software)."""
    sw_old, sw_new = dict(old["software"]), dict(new["software"])
    pk_old, pk_new = sw_old.pop("packages", {}), sw_new.pop("packages", {})
    lines = _compare(
        _flat("", pk_old if isinstance(pk_old, dict) else {}),
        _flat("", pk_new if isinstance(pk_new, dict) else {}),
        "package",
    )
    lines += _compare(_flat("", sw_old), _flat("", sw_new), "software")
    lines += _compare(_git(old), _git(new), "git")
    lines += _compare(_env(old), _env(new), "variable")
    return lines


def describe(run_dir: Path) -> list[str]:
    """What ``hpc report`` prints of a run's environment (nothing without a record)."""
    recs = load(run_dir)
    if not recs:
        return []
    last = recs[-1]
    nodes = last.get("nodes")
    lines = [
        f"environment: {len(recs)} fingerprint(s) in {run_dir}; latest: job "
        f"{last.get('job_id')}, {len(nodes) if isinstance(nodes, dict | list) else 0} node(s)"
    ]
    differ = last.get("nodes_differ") or []
    if isinstance(differ, list) and differ:
        lines.append(
            "environment: node(s) with other software than the rest: " + ", ".join(map(str, differ))
        )
    if len(recs) >= 2:
        changes = diff(recs[-2], last)
        head = f"environment: job {recs[-2].get('job_id')} -> job {last.get('job_id')}"
        lines.append(f"{head}: {len(changes)} change(s)" if changes else f"{head}: no change")
        lines += [f"  {c}" for c in changes]
    return [printable(line) for line in lines]  # the records are anyone's text
