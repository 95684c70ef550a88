"""A conda installation with the real layout and conda's observable shell behaviour.

Why not the real one: conda is neither in Debian nor usable from PyPI (the ``conda``
package there is a 2017 placeholder), micromamba is not in Debian, and nothing can be
downloaded on the test machines. What the job-script tests need of conda is small and
documented, and this reproduces exactly that (conda 23-24, ``conda/shell/etc/profile.d/
conda.sh`` and ``conda/activate.py``):

- the layout: ``ROOT/bin/conda``, ``ROOT/condabin/conda``, ``ROOT/conda-meta/``,
  environments in ``ROOT/envs/NAME`` (``conda-meta/history`` names the conda that made
  them), each with ``bin/`` and ``etc/conda/activate.d/*.sh``;
- ``conda activate`` run as the program (a shell that ran no ``conda init``, as a
  batch job's) prints ``CondaError: Run 'conda init' before 'conda activate'`` and exits 1;
- ``conda shell.bash hook`` prints the shell functions ``__conda_exe``,
  ``__conda_activate`` and ``conda``, exports ``CONDA_EXE`` and friends and puts
  ``ROOT/condabin`` on PATH; the function's ``activate ENV`` evals what
  ``conda shell.posix activate ENV`` prints: PATH with ``ENV/bin`` first,
  ``CONDA_PREFIX``, ``CONDA_DEFAULT_ENV``, ``CONDA_SHLVL``, then sources the
  environment's ``activate.d`` scripts; an unknown name or path fails with
  ``EnvironmentNameNotFound`` / ``EnvironmentLocationNotFound``, exit 1.
"""

from __future__ import annotations

from pathlib import Path

_CONDA = r"""#!/bin/bash
# hpc-ddp tests: conda's observable shell behaviour (tests/support/fakeconda.py)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
resolve() {
  case "$1" in
    base) echo "$root" ;;
    */*) echo "$1" ;;
    *) echo "$root/envs/$1" ;;
  esac
}
case "$1 $2" in
  "shell.bash hook")
    cat <<HOOK
export CONDA_EXE='$root/bin/conda'
export _CE_M=''
export _CE_CONDA=''
export CONDA_PYTHON_EXE='$root/bin/python'
__conda_exe() (
    "\$CONDA_EXE" \$_CE_M \$_CE_CONDA "\$@"
)
__conda_activate() {
    local ask_conda
    ask_conda="\$(PS1="\${PS1:-}" __conda_exe shell.posix "\$@")" || return
    eval "\$ask_conda"
    hash -r
}
conda() {
    local cmd="\${1-__missing__}"
    case "\$cmd" in
        activate|deactivate) __conda_activate "\$@" ;;
        *) __conda_exe "\$@" ;;
    esac
}
if [ -z "\${CONDA_SHLVL+x}" ]; then
    export CONDA_SHLVL=0
    export PATH="$root/condabin\${PATH:+:\${PATH}}"
fi
HOOK
    ;;
  "shell.posix activate")
    prefix="$(resolve "${3:-base}")"
    if [ ! -d "$prefix/conda-meta" ]; then
      case "$3" in
        */*) echo "EnvironmentLocationNotFound: Not a conda environment: $3" >&2 ;;
        *) echo "EnvironmentNameNotFound: Could not find conda environment: $3" >&2 ;;
      esac
      exit 1
    fi
    level=$(( ${CONDA_SHLVL:-0} + 1 ))
    echo "export PATH='$prefix/bin:$PATH'"
    echo "export CONDA_PREFIX='$prefix'"
    echo "export CONDA_SHLVL='$level'"
    echo "export CONDA_DEFAULT_ENV='$(basename "$prefix")'"
    for script in "$prefix"/etc/conda/activate.d/*.sh; do
      if [ -f "$script" ]; then echo ". \"$script\""; fi
    done
    ;;
  "activate "*|"deactivate "*)
    echo "" >&2
    echo "CondaError: Run 'conda init' before 'conda $1'" >&2
    exit 1
    ;;
esac
"""


def make_conda(root: Path) -> Path:
    """A conda installation at ``root`` (its base environment); returns ``root``."""
    for sub in ("bin", "condabin", "conda-meta", "envs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for exe in (root / "bin" / "conda", root / "condabin" / "conda"):
        exe.write_text(_CONDA)
        exe.chmod(0o755)
    (root / "conda-meta" / "history").write_text("")
    return root


def make_env(root: Path, prefix: Path | None = None, name: str = "torch") -> Path:
    """An environment of the conda at ``root``: ``root/envs/NAME``, or at ``prefix`` as
    ``conda create -p PREFIX`` makes it; its ``bin/hpc-probe`` prints its own path and
    an ``activate.d`` script exports ``FAKE_ENV_ACTIVATED`` (what a package's would do)."""
    prefix = root / "envs" / name if prefix is None else prefix
    (prefix / "bin").mkdir(parents=True, exist_ok=True)
    (prefix / "etc" / "conda" / "activate.d").mkdir(parents=True, exist_ok=True)
    (prefix / "conda-meta").mkdir(exist_ok=True)
    how = f"-p {prefix}" if prefix.parent != root / "envs" else f"-n {name}"
    (prefix / "conda-meta" / "history").write_text(
        f"==> 2026-01-01 00:00:00 <==\n# cmd: {root}/bin/conda create {how}\n"
        "# conda version: 24.1.2\n+defaults/linux-64::python-3.11.7-h955ad1f_0\n"
    )
    probe = prefix / "bin" / "hpc-probe"
    probe.write_text('#!/bin/sh\necho "probe=$0 activated=${FAKE_ENV_ACTIVATED:-no}"\n')
    probe.chmod(0o755)
    (prefix / "etc" / "conda" / "activate.d" / "fake.sh").write_text(
        f"export FAKE_ENV_ACTIVATED='{prefix.name}'\n"
    )
    return prefix
