"""A conda environment (``python: {conda: PREFIX}``, recorded by ``hpc submit`` from
``$CONDA_PREFIX``, or ``{conda: NAME}``) is activated through its own conda's shell hook:
a batch job's shell ran no ``conda init``, and a bare ``conda activate`` exits 1 with
"Run 'conda init'" (issue 24). The scripts run in bash with a clean environment."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpc import spec as hpc_spec
from hpc.render import render
from tests.hpc.conftest import make_job
from tests.support.fakeconda import make_conda, make_env

PROBE = ["bash", "-c", 'echo "prefix=$CONDA_PREFIX"; hpc-probe']


def _run(
    text: str, tmp_path: Path, path: str = "/usr/bin:/bin"
) -> subprocess.CompletedProcess[str]:
    """The script in a shell as a batch job's: no conda function, no CONDA_* variables."""
    script = tmp_path / "job.sh"
    script.write_text(text)
    return subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": path, "HOME": str(tmp_path)},
    )


def _script(cluster: str, env: str) -> str:
    extra = {"account": "p"} if cluster == "aurora" else {}
    return render(make_job(cluster, python={"conda": env}, command=PROBE, wrap="never", **extra))


@pytest.mark.parametrize("conda_on_path", [False, True], ids=["no-conda-on-PATH", "conda-on-PATH"])
def test_a_recorded_prefix_activates_without_conda_init(
    tmp_path: Path, conda_on_path: bool
) -> None:
    root = make_conda(tmp_path / "miniconda3")
    env = make_env(root)
    path = f"{root / 'bin'}:/usr/bin:/bin" if conda_on_path else "/usr/bin:/bin"
    proc = _run(_script("local", str(env)), tmp_path, path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Run 'conda init'" not in proc.stderr
    assert f"prefix={env}\n" in proc.stdout
    assert f"probe={env}/bin/hpc-probe activated=torch" in proc.stdout  # its activate.d ran


def test_the_environments_own_conda_is_used_not_the_first_on_path(tmp_path: Path) -> None:
    """Two installations: the job activates its environment with the conda it belongs to."""
    mine = make_conda(tmp_path / "mine")
    other = make_conda(tmp_path / "other")
    env = make_env(mine)
    text = _script("local", str(env))
    assert f"{mine}/bin/conda shell.bash hook" in text
    proc = _run(text, tmp_path, f"{other / 'bin'}:/usr/bin:/bin")
    assert proc.returncode == 0 and f"prefix={env}\n" in proc.stdout, proc.stdout + proc.stderr


def test_an_environment_made_with_conda_create_p_elsewhere(tmp_path: Path) -> None:
    root = make_conda(tmp_path / "conda")
    env = make_env(root, prefix=tmp_path / "project" / "envs with space" / "ddp")
    assert hpc_spec.conda_executable(str(env)) == str(root / "bin" / "conda")
    proc = _run(_script("local", str(env)), tmp_path)
    assert proc.returncode == 0 and f"prefix={env}\n" in proc.stdout, proc.stdout + proc.stderr


def test_the_base_environment(tmp_path: Path) -> None:
    root = make_conda(tmp_path / "conda")
    (root / "bin" / "hpc-probe").symlink_to(make_env(root) / "bin" / "hpc-probe")
    assert hpc_spec.conda_executable(str(root)) == str(root / "bin" / "conda")
    proc = _run(_script("local", str(root)), tmp_path)
    assert proc.returncode == 0 and f"prefix={root}\n" in proc.stdout, proc.stdout + proc.stderr


def test_a_name_uses_the_conda_of_the_jobs_path(tmp_path: Path) -> None:
    """``{conda: NAME}``: the conda the profile's modules put on PATH (Polaris' ``module load
    conda``) defines the function first; the name is that installation's environment."""
    root = make_conda(tmp_path / "conda")
    env = make_env(root, name="ddp")
    text = _script("local", "ddp")
    assert 'eval "$(conda shell.bash hook)"' in text
    proc = _run(text, tmp_path, f"{root / 'bin'}:/usr/bin:/bin")
    assert proc.returncode == 0 and f"prefix={env}\n" in proc.stdout, proc.stdout + proc.stderr


def test_a_missing_environment_stops_the_job(tmp_path: Path) -> None:
    root = make_conda(tmp_path / "conda")
    proc = _run(
        _script("local", str(root / "envs" / "gone")), tmp_path, f"{root / 'bin'}:/usr/bin:/bin"
    )
    assert proc.returncode != 0 and "prefix=" not in proc.stdout
    assert "EnvironmentLocationNotFound" in proc.stderr, proc.stderr


@pytest.mark.parametrize("cluster", ["slurm", "pbs", "aurora"])
def test_every_scheduler_activates_the_same_way(tmp_path: Path, cluster: str) -> None:
    """The common template: the batch scripts carry the lines the local script runs above."""
    root = make_conda(tmp_path / "conda")
    env = make_env(root)
    lines = [
        ln
        for ln in _script("local", str(env)).splitlines()
        if "conda" in ln and not ln.startswith("#")
    ]
    assert len(lines) == 2 and lines[1] == f"conda activate {env}", lines
    assert "\n".join(lines) + "\n" in _script(cluster, str(env))


def test_conda_executable_is_none_for_what_is_no_conda_environment(tmp_path: Path) -> None:
    assert hpc_spec.conda_executable(str(tmp_path / "nothing")) is None
    (tmp_path / "env" / "conda-meta").mkdir(parents=True)
    assert hpc_spec.conda_executable(str(tmp_path / "env")) is None  # no history, not under envs/
    (tmp_path / "env" / "conda-meta" / "history").write_text("# cmd: relative/conda create\n")
    assert hpc_spec.conda_executable(str(tmp_path / "env")) is None
