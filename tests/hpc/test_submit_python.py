"""`hpc submit` records the Python environment it runs from, so a PBS job (whose qsub passes
no environment) runs with the same Python as a SLURM job; spec `python:` wins, `site` opts out."""

from __future__ import annotations

import venv
from pathlib import Path

import pytest

from hpc.cli import main as cli_main
from hpc.errors import UserError
from hpc.spec import JobSpec, submitting_python


def _venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=False, symlinks=True).create(str(where))
    return where


def test_activated_venv_first(tmp_path: Path) -> None:
    a, b = _venv(tmp_path / "a"), _venv(tmp_path / "b")
    assert submitting_python({"VIRTUAL_ENV": str(a)}, prefix=str(b), base_prefix="/usr") == {
        "venv": str(a)
    }


def test_running_interpreter_venv_when_nothing_is_activated(tmp_path: Path) -> None:
    b = _venv(tmp_path / "b")
    assert submitting_python({}, prefix=str(b), base_prefix="/usr") == {"venv": str(b)}
    # a stale $VIRTUAL_ENV (folder gone) is not recorded
    assert submitting_python(
        {"VIRTUAL_ENV": str(tmp_path / "gone")}, prefix=str(b), base_prefix="/usr"
    ) == {"venv": str(b)}


def test_conda_prefix_then_nothing(tmp_path: Path) -> None:
    conda = tmp_path / "envs" / "torch"
    (conda / "conda-meta").mkdir(parents=True)
    assert submitting_python({"CONDA_PREFIX": str(conda)}, prefix="/usr", base_prefix="/usr") == {
        "conda": str(conda)
    }
    assert submitting_python({}, prefix="/usr", base_prefix="/usr") is None
    assert (
        submitting_python({"CONDA_PREFIX": str(tmp_path)}, prefix="/usr", base_prefix="/usr")
        is None
    )


def test_spec_python_site_and_bad_values() -> None:
    assert JobSpec.from_mapping({"python": "site"}).python == "site"
    with pytest.raises(UserError, match="allowed: .*site"):
        JobSpec.from_mapping({"python": "system"})


def _dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    code = cli_main(
        [
            "submit",
            "--cluster",
            "pbs",
            "--dry-run",
            "--runs-dir",
            str(tmp_path),
            *extra,
            "--",
            "python",
            "train.py",
        ]
    )
    assert code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("cluster", ["pbs", "slurm"])
def test_submit_activates_the_recorded_venv_after_the_modules(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    cluster: str,
) -> None:
    env = _venv(tmp_path / "my venv")
    monkeypatch.setenv("VIRTUAL_ENV", str(env))
    monkeypatch.setenv("PBS_ACCOUNT", "p")
    code = cli_main(
        [
            "submit",
            "--cluster",
            cluster,
            "--dry-run",
            "--runs-dir",
            str(tmp_path),
            "--",
            "python",
            "train.py",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert f"source '{env}/bin/activate'" in out  # quoted: the path holds a space


def test_profile_modules_come_first_and_site_records_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = _venv(tmp_path / "v")
    monkeypatch.setenv("VIRTUAL_ENV", str(env))
    spec = tmp_path / "job.yaml"
    spec.write_text("cluster: aurora\naccount: p\ncommand: [python, train.py]\n")
    assert cli_main(["submit", str(spec), "--dry-run", "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.index("module load frameworks") < out.index(f"source {env}/bin/activate")
    spec.write_text("cluster: aurora\naccount: p\npython: site\ncommand: [python, train.py]\n")
    assert cli_main(["submit", str(spec), "--dry-run", "--runs-dir", str(tmp_path)]) == 0
    assert "activate" not in capsys.readouterr().out
