"""The PBS tests' job venv (tests/support/openpbs.py:job_venv) sees what the interpreter
running the tests sees, whether that is the system Python or a venv (issue 24: from a
venv, the job's Python had no torch and the preemption test failed on every fresh clone)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "hpc_ddp_only_in_the_test_venv"


def _python(env: Path, code: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(env / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean,
        cwd="/",
    )


def test_a_job_venv_made_from_a_venv_imports_that_venvs_packages(tmp_path: Path) -> None:
    """A user's venv (here over this interpreter, with a module only it has, standing for
    torch) runs the fixture; the job's Python must import that module and this checkout."""
    user = tmp_path / "user-venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(str(user))
    purelib = _python(user, "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    Path(purelib, f"{MARKER}.py").write_text("VALUE = 42\n")
    # what this interpreter imports (pytest, yaml), whether it is a venv or not
    Path(purelib, "test-interpreter.pth").write_text(
        "\n".join(p for p in sys.path if p and Path(p).is_dir() and p != purelib) + "\n"
    )
    made = _python(
        user,
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
        "from tests.support.openpbs import job_venv; "
        f"job_venv(Path({str(tmp_path / 'job-venv')!r}))",
    )
    assert made.returncode == 0, made.stderr
    seen = _python(
        tmp_path / "job-venv",
        f"import {MARKER}, hpc, ddp, pytest; print({MARKER}.VALUE, hpc.__file__, ddp.__file__)",
    )
    assert seen.returncode == 0, seen.stderr
    value, hpc_file, ddp_file = seen.stdout.split()
    assert value == "42"
    assert Path(hpc_file).is_relative_to(ROOT) and Path(ddp_file).is_relative_to(ROOT)


def test_a_job_venv_made_from_this_interpreter_imports_what_it_imports(tmp_path: Path) -> None:
    from tests.support.openpbs import job_venv

    env = job_venv(tmp_path / "job-venv")
    wanted = [
        m
        for m in ("torch", "submitit", "yaml", "jinja2")
        if m in sys.modules or __import__("importlib.util").util.find_spec(m) is not None
    ]
    seen = _python(
        env, f"import {', '.join(['hpc', 'ddp', *wanted])}; import hpc; print(hpc.__file__)"
    )
    assert seen.returncode == 0, seen.stderr
    assert Path(seen.stdout.strip()).is_relative_to(ROOT)
