"""DDP_SET: --set items from the environment, for checked-in job scripts one cannot edit
per run (`sbatch --export=ALL,DDP_SET=... jobs/uniref50.slurm`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _print_config(env_set: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DDP_SET"}
    env["PYTHONPATH"] = f"{ROOT / 'src'}:{ROOT}"
    if env_set is not None:
        env["DDP_SET"] = env_set
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp",
            "uniref50",
            "--config",
            "configs/uniref50.yaml",
            "--print-config",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_env_items_override_the_file_and_the_command_line_set_wins() -> None:
    out = _print_config(
        "model.d_model=96 'optim.lr=2e-3' training.max_steps=7", "--set", "training.max_steps=9"
    )
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["model"]["d_model"] == 96 and cfg["optim"]["lr"] == pytest.approx(2e-3)
    assert cfg["training"]["max_steps"] == 9  # the explicit --set comes later and wins
    plain = yaml.safe_load(_print_config(None).stdout)
    assert plain["model"]["d_model"] == 768  # without it: the file's (the seed's) value


@pytest.mark.parametrize(
    "value, words",
    [
        ("model.d_model", "is not KEY=VALUE"),
        ("optim.lr='1e-3", "No closing quotation"),
        ("nosuch.key=1", "nosuch"),
    ],
)
def test_bad_items_are_one_line_exit_2(value: str, words: str) -> None:
    out = _print_config(value)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
