"""The real OpenPBS server for PBS tests, a Python environment for its jobs, and Lmod.

Why a real server: every belief about PBS that the tests encode (states, substates,
exit codes, which directives are accepted, how qdel/qrerun/walltime kills look) is
checked against what PBS really does. The server is the prebuilt OpenPBS 23.06 in
``<checkout>/../shared/pbs``, started by ``scripts/openpbs.sh start`` (root only; CI
runs it before the tests and this module starts it if it is not up yet). One host,
4 vnodes (``select=2`` works), ALCF-like queues and the custom resources ``system``
and ``filesystems``; see ../shared/pbs/README.md.

Three things a job needs that only the submitting side has:

- the PBS clients first on PATH: ``/opt/pbs/bin`` (Debian's slurm-wlm-torque puts a
  different ``qsub`` at /usr/bin/qsub);
- a Python environment with this checkout: :func:`job_venv` makes a virtual
  environment whose ``.pth`` files name this checkout and then every site folder of the
  test interpreter (so torch and submitit come from wherever the tests run: a venv
  or the system Python). ``hpc submit`` run from it records it
  (``hpc.spec.submitting_python``), as it does for a user's venv;
- for the ALCF profiles' ``module load frameworks``: a real module system (Debian's
  ``lmod``; a PBS job's login shell reads /etc/profile.d/lmod.sh) and a ``frameworks``
  modulefile, written by :func:`site_modules` into Lmod's site folder
  ``/etc/lmod/modules`` (removed afterwards). On Aurora ``frameworks`` is ALCF's conda
  environment with torch and PALS ``mpiexec`` comes with the default environment;
  here the modulefile puts the test's venv and the PALS-compatible ``mpiexec`` shim
  (tests/support/pals: no PALS exists on this machine) first on PATH.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import venv
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.pals import PALS_DIR
from tests.support.parts import require
from tests.support.polling import wait_state, wait_until

ROOT = Path(__file__).resolve().parents[2]
PBS_BIN = Path("/opt/pbs/bin")
WRAPPER = ROOT / "scripts" / "openpbs.sh"
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")
LMOD_SITE = Path("/etc/lmod/modules")  # Debian's Lmod: the first folder of /etc/lmod/modulespath
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


def _client_env() -> dict[str, str]:
    return dict(os.environ, PATH=f"{PBS_BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def server_up() -> bool:
    """True when ``qstat -B`` answers (pbs_server running and reachable)."""
    qstat = PBS_BIN / "qstat"
    if not qstat.exists():
        return False
    proc = subprocess.run(
        [str(qstat), "-B"],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=30,
        env=_client_env(),
        check=False,
    )
    return proc.returncode == 0


def ensure_started() -> str | None:
    """Start the server through scripts/openpbs.sh unless it is up; the reason it is not."""
    if server_up():
        return None
    if os.geteuid() != 0:
        return "OpenPBS is not running and starting it needs root (scripts/openpbs.sh start)"
    proc = subprocess.run(
        ["bash", str(WRAPPER), "start"], capture_output=True, text=True, timeout=600, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-4:]
        return f"scripts/openpbs.sh start failed (exit {proc.returncode}): {' | '.join(tail)}"
    return None if server_up() else "OpenPBS started but qstat -B does not answer"


@dataclass
class OpenPBS:
    """Client-side helpers for the running server (``/opt/pbs/bin`` first on PATH)."""

    bin: Path = PBS_BIN

    def run(self, *argv: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        # errors="replace": the shared server's history may hold a job whose variables
        # are not UTF-8 (tests/test_e2e_clients.py makes one), and `qstat -x` lists it.
        proc = subprocess.run(
            [str(self.bin / argv[0]), *argv[1:]],
            capture_output=True,
            encoding="utf-8",
            errors="replace",
            timeout=60,
            check=False,
            **kw,
        )
        if check:
            assert proc.returncode == 0, f"{argv}: {proc.returncode}\n{proc.stdout}{proc.stderr}"
        return proc

    def attrs(self, job_id: str, subjobs: bool = False) -> dict[str, Any]:
        """The job's attributes from ``qstat -x -f -F json`` ({} if unknown)."""
        argv = ["qstat", "-x", "-f", "-F", "json", *(["-t"] if subjobs else []), job_id]
        proc = self.run(*argv, check=False)
        if not proc.stdout.strip():
            return {}
        jobs = json.loads(proc.stdout).get("Jobs") or {}
        return jobs.get(job_id) or next(iter(jobs.values()), {})

    def wait_letter(
        self, job_id: str, letters: str, timeout: float = 60, log: Callable[[], str] | None = None
    ) -> dict[str, Any]:
        """Poll until job_state is one of ``letters``; returns the attributes then.

        A job that finishes (``F``) before reaching them ends the wait at once; the
        failure quotes ``log()``, by default the file of the job's ``Output_Path``."""
        found: dict[str, Any] = {}

        def check() -> bool:
            found.update(self.attrs(job_id))
            return str(found.get("job_state")) in letters

        def ended() -> str | None:
            if "F" in letters or str(found.get("job_state")) != "F":
                return None
            return f"F, substate {found.get('substate')}, Exit_status {found.get('Exit_status')}"

        wait_until(
            check,
            timeout,
            f"PBS job {job_id} in state {letters}",
            ended=ended,
            log=log or (lambda: output_of(found)),
        )
        return found

    def delete_all(self, job_ids: list[str]) -> None:
        """``qdel -W force`` whatever a test left queued or running, then reap its processes
        (and the pyenv lock a killed job's login shell may have left)."""
        # latest first: a job that waits on an earlier one (``--after``) goes before it, so
        # deleting the earlier one never releases it to start (and be killed at once)
        for job_id in reversed(job_ids):
            if self.attrs(job_id).get("job_state") not in (None, "F"):
                self.run("qdel", "-W", "force", job_id, check=False)
        reap(job_ids)
        clear_stale_pyenv_lock()


#: pyenv's rehash lock (``pyenv-rehash``: a file made with ``noclobber``, removed by an EXIT
#: trap): the lock of the pyenv that this machine's ~/.bashrc initialises.
PYENV_LOCK = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "shims" / ".pyenv-shim"


def clear_stale_pyenv_lock(lock: Path = PYENV_LOCK) -> bool:
    """Remove pyenv's rehash lock when no ``pyenv-rehash`` process is alive to own it.

    Why: a PBS job runs in a login shell, and this machine image's ~/.bashrc runs
    ``eval "$(pyenv init -)"``, which runs ``pyenv rehash`` in every job before its
    script. A job killed during it (``qdel -W force`` and :func:`reap` send SIGKILL, so
    the EXIT trap never runs) leaves the lock, and from then on every PBS job's shell
    waits ``PYENV_REHASH_TIMEOUT`` (60 s) before its script starts. Seen under load: a
    teardown deleted an array first, which released the job waiting on it, then deleted
    that job in the second it started; the next four ALCF-profile tests' jobs each
    waited 60 s and ran past their tests' waits. Not a site's behaviour: the tests' own
    kills leave it, so the tests clean it, and only when its owner is gone.
    Returns whether a lock was removed.
    """
    if not lock.is_file():
        return False
    root = b"PYENV_ROOT=" + str(lock.parent.parent).encode()  # pyenv exports it to rehash
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or b"pyenv-rehash" not in (proc / "cmdline").read_bytes():
                continue
            if root in (proc / "environ").read_bytes().split(b"\0"):
                return False  # a rehash of this pyenv runs: the lock is (or will be) its own
        except OSError:  # the process ended meanwhile
            continue
    try:
        lock.unlink()
    except FileNotFoundError:
        return False
    return True


def reap(job_ids: list[str]) -> list[int]:
    """SIGKILL processes of these jobs that outlived them; returns their pids.

    Why: without cgroups, pbs_mom ends a job by signalling the job's session. MPICH
    hydra's proxies call ``setsid``, so ranks (and, once the login shell is gone, the
    ``mpiexec`` that waits for them) are not in it: after ``qdel``/``qrerun`` a rank that
    handles SIGTERM (submitit's do) keeps running although PBS reports the job ended
    (seen on this server). A site's cgroup hook (or PALS) ends them; here the tests do,
    finding them by the ``PBS_JOBID`` in their environment.
    """

    def key(job_id: str) -> tuple[str, str]:  # 12[3].srv and 12[].srv -> ("12", "srv")
        head, _, server = job_id.partition(".")
        return head.split("[")[0], server

    seqs = {key(j) for j in job_ids if j}
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = proc.joinpath("environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ids = [
            e[len(b"PBS_JOBID=") :].decode(errors="replace")
            for e in env
            if e.startswith(b"PBS_JOBID=")
        ]
        if ids and key(ids[0]) in seqs:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
            except OSError:
                pass
    return killed


def job_venv(where: Path) -> Path:
    """A venv that imports this checkout's ``hpc`` and ``ddp`` and, after them, whatever
    the test interpreter imports (torch, submitit, ...), from a venv as from the system.

    Why not ``--system-site-packages``: a venv's base is the system interpreter, never
    the venv it was made from, so tests run from a venv (the README's way) gave their
    jobs a Python without that venv's torch (``No module named 'torch'`` in the job's
    log). So the new venv sees no site folder of its own base; its ``.pth`` files name
    the checkout (``src/`` and the root, for ``hpc`` and ``tests``: a plain path beats an
    editable install's import hook, which only runs when the path finder fails), then
    add every site folder of the running interpreter with ``site.addsitedir``, in its
    order, so their own ``.pth`` files (editable installs) work as they do here.
    """
    import site

    if not (where / "bin" / "python").exists():
        builder = venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True)
        builder.create(str(where))
    purelib = subprocess.run(
        [
            str(where / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    Path(purelib, "00-hpc-ddp-checkout.pth").write_text(f"{ROOT / 'src'}\n{ROOT}\n")
    folders = [
        *site.getsitepackages(),
        *([site.getusersitepackages()] if site.ENABLE_USER_SITE else []),
    ]
    folders = [f for f in dict.fromkeys(folders) if Path(f).is_dir() and f != purelib]
    # one line: a .pth runs lines that start with "import" (site.addsitedir of each folder)
    Path(purelib, "01-test-interpreter-site.pth").write_text(
        f"import site; list(map(site.addsitedir, {folders!r}))\n"
    )
    return where


def site_modules(venv_dir: Path, tag: str) -> Iterator[Path]:
    """Write the ``frameworks`` modulefile (Lmod, Lua) into the site folder; yield it."""
    folder = LMOD_SITE / "frameworks"
    folder.mkdir(parents=True, exist_ok=True)
    # A session that was killed leaves its file behind; `module load frameworks` takes the
    # highest version, which could be that stale one (its venv gone): remove ours first.
    for stale in folder.glob("hpc-ddp-test*.lua"):
        stale.unlink(missing_ok=True)
    path = folder / f"{tag}.lua"
    path.write_text(
        "-- hpc-ddp tests: stands for ALCF's `frameworks` module (a Python with torch).\n"
        "-- Written by tests/support/openpbs.py, removed when the test session ends.\n"
        f'whatis("hpc-ddp test environment {venv_dir}")\n'
        f'setenv("VIRTUAL_ENV", "{venv_dir}")\n'
        f'prepend_path("PATH", "{PALS_DIR}")  -- PALS mpiexec shim (no PALS here)\n'
        f'prepend_path("PATH", "{venv_dir / "bin"}")\n'
    )
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def output_of(attrs: dict[str, Any]) -> str:
    """The job's log from its ``Output_Path`` (``host:PATH``; ``-o DIR/``: ``DIR/ID.OU``)."""
    path = Path(str(attrs.get("Output_Path", "")).partition(":")[2] or "/nonexistent")
    if path.is_dir():
        head = str(attrs.get("job_id", "")).split(".")[0].split("[")[0]
        files = sorted(p for p in path.glob("*.OU") if p.name.startswith(head)) if head else []
        return "\n".join(p.read_text(errors="replace") for p in files)
    return path.read_text(errors="replace") if path.is_file() else ""


def wait_final(status: Any, timeout: float, what: str, log: Callable[[], str] | None = None) -> str:
    """Poll ``status()`` (a normalized state) until it is final; return it. A timeout
    names the last state and quotes ``log()``."""
    return wait_state(status, FINAL, FINAL, timeout, what, log)


def python_of(venv_dir: Path) -> str:
    """The venv's interpreter path (for running ``hpc`` as a user of that venv does)."""
    return str(venv_dir / "bin" / "python")


# --- pytest fixtures (registered through tests/support/fixtures.py) -----------------


@pytest.fixture(scope="session")
def openpbs_server() -> OpenPBS:
    """The running server, started once per session if needed.

    Skips with the reason on a machine without ../shared/pbs (or not root); under
    CI=true that fails instead (tests/support/parts.py).
    """
    require(WRAPPER.is_file(), f"{WRAPPER} is missing")
    reason = ensure_started()
    require(reason is None, reason or "")
    return OpenPBS()


@pytest.fixture
def openpbs(openpbs_server: OpenPBS, monkeypatch: pytest.MonkeyPatch) -> OpenPBS:
    """The server, with ``/opt/pbs/bin`` first on PATH for this test only: later tests
    that mean Debian's ``/usr/bin/qsub`` (the slurm-wlm-torque smoke test) still get it."""
    monkeypatch.setenv("PATH", f"{PBS_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    clear_stale_pyenv_lock()  # left by an earlier test's killed job (or a walltime kill)
    return openpbs_server


@pytest.fixture(scope="session")
def pbs_job_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with this checkout for PBS jobs (qsub passes no environment)."""
    return job_venv(tmp_path_factory.mktemp("pbs-venv") / "venv")


@pytest.fixture(scope="session")
def lmod_frameworks(pbs_job_venv: Path) -> Iterator[Path]:
    """Lmod installed and a ``frameworks`` modulefile that activates ``pbs_job_venv``."""
    require(LMOD_INIT.is_file(), f"Lmod is not installed ({LMOD_INIT}; apt-get install lmod)")
    require(os.access(LMOD_SITE.parent, os.W_OK), f"{LMOD_SITE} is not writable (not root?)")
    yield from site_modules(pbs_job_venv, "hpc-ddp-test")
