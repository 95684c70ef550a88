"""Run directories: every submission leaves one, and none is ever overwritten.

``runs/NAME-YYYYmmdd-HHMMSS/`` holds the rendered script, the resolved spec
(``spec.yaml``), and ``run.json`` with the submit command, scheduler, job id, git
commit and dirty flag. A name that exists already gets ``-2``, ``-3``, ...
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from hpc.errors import UserError

RECORD = "run.json"


def new_run_dir(runs_dir: Path, name: str, now: float | None = None) -> Path:
    """Create a fresh directory (``os.mkdir`` is atomic: two submissions never share one)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"runs-dir: cannot create {str(runs_dir)!r}: {exc.strerror}") from None
    base = f"{name}-{stamp}"
    for i in range(1, 1000):
        path = runs_dir / (base if i == 1 else f"{base}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UserError(f"runs-dir: too many runs named {base!r} in {str(runs_dir)!r}")


def free_name(run_dir: Path, stem: str, suffix: str) -> Path:
    """``stem+suffix`` in ``run_dir``, or ``stem-2+suffix``, ... : the first that does not exist."""
    for i in range(1, 1000):
        path = run_dir / (f"{stem}{suffix}" if i == 1 else f"{stem}-{i}{suffix}")
        if not path.exists():
            return path
    raise UserError(f"resume: too many submissions in {str(run_dir)!r}")


def git_info(cwd: Path | None = None) -> dict[str, Any]:
    """The commit and whether the tree is dirty; empty when not in a git repository."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return {"git_commit": None, "git_dirty": None}
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd, capture_output=True, text=True, timeout=10,
        )
        return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return {"git_commit": None, "git_dirty": None}


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Write ``run.json`` through a temporary file so a reader never sees half of it."""
    tmp = run_dir / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / RECORD)


def read_record(run_dir: Path) -> dict[str, Any]:
    """The record of a run directory."""
    try:
        return json.loads((run_dir / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"run: {str(run_dir)!r} has no readable {RECORD} ({exc})") from None


def find(ident: str, runs_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """A run directory given by path, by name under ``runs_dir``, or by its job id."""
    for candidate in (Path(ident), runs_dir / ident):
        if (candidate / RECORD).is_file():
            return candidate, read_record(candidate)
    if runs_dir.is_dir():
        for rec_path in sorted(runs_dir.glob(f"*/{RECORD}"), reverse=True):
            try:
                rec = json.loads(rec_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            job_id = str(rec.get("job_id") or "")
            if job_id and (job_id == ident or job_id.split(".")[0] == ident):
                return rec_path.parent, rec
    return None
