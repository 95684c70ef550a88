"""Every checked-in ``jobs/*.pbs`` is accepted by ``qsub`` on the real OpenPBS server from
a fresh clone, and its ``-o``/``-e`` folder exists there before the job could start.

Why the folder is kept in git (``logs/.gitkeep``) rather than made by the script: PBS
opens the output path on the execution host before any line of the script runs (with
``-k doe`` the file is written in place from the start), and a missing folder holds the
job ("job held, too many failed attempts to run": ALCF,
https://docs.alcf.anl.gov/running-jobs/known-issues/). ``hpc submit`` needs no such
folder: it writes the log into the run directory it creates before ``qsub``.

Shares the one OpenPBS server: run under ``flock /tmp/hpc-openpbs.lock``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.hpc.conftest import REPO


def _fresh_clone(dest: Path) -> Path:
    """The tracked files of jobs/ and logs/ as a clone gets them (working-tree content,
    untracked files such as a local logs/*.OU left out)."""
    tracked = (
        subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "jobs", "logs"],
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, tracked):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, dest / rel)
    return dest


def test_checked_in_pbs_jobs_qsub_from_a_fresh_clone(openpbs: Any, tmp_path: Path) -> None:
    clone = _fresh_clone(tmp_path / "clone")
    scripts = sorted((clone / "jobs").glob("*.pbs"))
    assert len(scripts) >= 5
    ids: list[str] = []
    try:
        for script in scripts:
            # -h: held, never run (the jobs train real models); -A: the account the
            # checked-in scripts leave to the submitter, as their comment says
            proc = openpbs.run(
                "qsub", "-h", "-A", "proj", f"jobs/{script.name}", cwd=clone, check=False
            )
            assert proc.returncode == 0, f"{script.name}: {proc.stderr.strip()}"
            ids.append(proc.stdout.strip())
            attrs = openpbs.attrs(ids[-1])
            for key in ("Output_Path", "Error_Path"):
                where = Path(str(attrs[key]).split(":", 1)[1])
                folder = where if str(attrs[key]).endswith("/") else where.parent
                assert folder.is_relative_to(clone) and folder.is_dir(), (script.name, key, where)
    finally:
        openpbs.delete_all(ids)
