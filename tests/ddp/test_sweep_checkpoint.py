"""A sweep task checkpoints and logs its metrics in a folder of its own (issue 24).

``hpc submit --sweep`` refuses ``--set checkpoint.dir=/shared`` at submit
(tests/hpc/test_sweep_cli.py); a recipe flag (``--output_dir``) or a ``--config`` file
that points every task at one folder only shows inside the task, here. Before, task 1
resumed task 0's checkpoint, trained 0 steps and ended COMPLETED.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp import recipes
from ddp.errors import ConfigError


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The environment ``python -m hpc.sweep shell`` gives task 1 of a sweep over optim.lr."""
    folder = tmp_path / "run" / "001-lr-0.02"
    folder.mkdir(parents=True)
    monkeypatch.setenv("HPC_RUN_DIR", str(folder))
    monkeypatch.setenv("HPC_SWEEP_INDEX", "1")
    monkeypatch.setenv("HPC_SWEEP_KEYS", "optim.lr")
    return folder


def _resolve(
    config_file: Path | None = None, sets: tuple[str, ...] = (), flags: dict[str, str] | None = None
) -> str | None:
    cfg = recipes.resolve(recipes.get("uniref50"), config_file, list(sets), flags or {})
    return cfg.checkpoint.dir


@pytest.mark.parametrize("how", ["flag", "set", "config", "climbs-out"])
def test_a_folder_every_task_would_share_is_one_line(how: str, task: Path, tmp_path: Path):
    shared = str(tmp_path / "shared")
    config = tmp_path / "c.yaml"
    config.write_text(f"checkpoint:\n  dir: {shared}\n")
    kwargs = {
        "flag": {"flags": {"output_dir": shared}},
        "set": {"sets": (f"checkpoint.dir={shared}",)},
        "config": {"config_file": config},
        "climbs-out": {"sets": ("checkpoint.dir=../shared",)},
    }[how]
    with pytest.raises(ConfigError) as info:
        _resolve(**kwargs)
    message = str(info.value)
    assert "checkpoint.dir" in message and "sweep task" in message and "\n" not in message
    assert str(task) in message


@pytest.mark.parametrize("sets", [(), ("checkpoint.dir=ck",), ("checkpoint.dir=null",)])
def test_a_folder_of_the_tasks_own_or_none_is_fine(sets: tuple[str, ...], task: Path):
    directory = _resolve(sets=sets)
    assert directory is None or directory == "" or Path(directory).is_relative_to(task)


def test_an_absolute_folder_inside_the_task_or_swept_per_task_is_fine(
    task: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    assert _resolve(flags={"output_dir": str(task / "out")}) == str(task / "out")
    monkeypatch.setenv("HPC_SWEEP_KEYS", "optim.lr,checkpoint.dir")  # hpc checked each is own
    assert _resolve(sets=(f"checkpoint.dir={tmp_path / 'b'}",)) == str(tmp_path / "b")


def test_outside_a_sweep_any_folder_is_fine(
    task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("HPC_SWEEP_INDEX")
    assert _resolve(flags={"output_dir": str(tmp_path / "x")}) == str(tmp_path / "x")


@pytest.mark.parametrize("value", ["ABS", "metrics.jsonl"])
def test_a_metrics_file_every_task_would_share_is_one_line(value: str, task: Path, tmp_path: Path):
    """An explicit ``logging.metrics_file`` outside the task's folder (an absolute path, or
    a relative one, taken from the job's working directory: the same for every task)."""
    path = str(tmp_path / "all.jsonl") if value == "ABS" else value
    with pytest.raises(ConfigError) as info:
        _resolve(sets=(f"logging.metrics_file={path}",))
    message = str(info.value)
    assert "logging.metrics_file" in message and "sweep task" in message and "\n" not in message


@pytest.mark.parametrize(
    "sets", [(), ("logging.metrics_file=auto",), ("logging.metrics_file=null",)]
)
def test_the_default_metrics_file_or_none_is_fine(sets: tuple[str, ...], task: Path):
    cfg = recipes.resolve(recipes.get("uniref50"), None, list(sets), {})
    assert cfg.logging.metrics_file in ("auto", None, "")


def test_a_metrics_file_inside_the_task_or_swept_is_fine(
    task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    inside = str(task / "m.jsonl")
    cfg = recipes.resolve(recipes.get("uniref50"), None, [f"logging.metrics_file={inside}"], {})
    assert cfg.logging.metrics_file == inside
    monkeypatch.setenv("HPC_SWEEP_KEYS", "optim.lr,logging.metrics_file")
    outside = str(tmp_path / "x.jsonl")
    cfg = recipes.resolve(recipes.get("uniref50"), None, [f"logging.metrics_file={outside}"], {})
    assert cfg.logging.metrics_file == outside
