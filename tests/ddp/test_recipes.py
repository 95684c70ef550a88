"""Recipes train for real (loss falls) and `python -m ddp` behaves as a CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddp
from ddp import recipes
from ddp.trainer import Trainer
from tests.ddp._launch import base_env
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def _eval_loss(built: recipes.Built) -> float:
    loader = torch.utils.data.DataLoader(
        built.eval_data, batch_size=64, collate_fn=built.collate_fn
    )
    fn = built.eval_fn or built.step_fn or (lambda m, b: m(b))
    built.model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            out = fn(built.model, batch)
            k = batch.shape[0] if isinstance(batch, torch.Tensor) else int(out.get("n", 0))
            total += float(out["loss"]) * k
            n += k
    built.model.train()
    return total / n


@pytest.mark.parametrize(
    ("name", "sets", "drop"),
    [
        # SEDD starts at the uniform posterior (about ln 22 = 3.09 nats a position) and the
        # amino-acid frequencies alone bring it near 2.9: 2 tiny epochs pass that by little.
        ("uniref50", ["training.epochs=2"], 0.12),
        # dpo's seed lr (3e-7) and batch (1) are for a pretrained model; the tiny demo
        # GPT-2 learns in 2 epochs at the old demo settings
        ("dpo", ["training.epochs=2", "optim.lr=1e-3", "training.batch_size=16"], 0.05),
    ],
)
def test_recipe_loss_falls(name: str, sets: list[str], drop: float, tmp_path: Path) -> None:
    recipe = recipes.get(name)
    config = (
        ROOT / "configs" / "uniref50-tiny.yaml" if name == "uniref50" else None
    )  # not SEDD small
    cfg = recipes.resolve(
        recipe, config, [*sets, f"checkpoint.dir={tmp_path}", "logging.progress=off"]
    )
    built = recipe.build(cfg)
    before = _eval_loss(built)
    summary = Trainer(
        built.model,
        built.train_data,
        cfg,
        built.step_fn,
        built.eval_data,
        built.eval_fn,
        built.collate_fn,
    ).fit()
    ddp.shutdown()
    assert summary["eval_loss"] < before - drop, (before, summary)
    if name == "dpo":
        assert summary["eval_reward_acc"] > 0.6
    assert (tmp_path / "final" / "model.pt").is_file()


def test_dpo_flags_map_to_config() -> None:
    recipe = recipes.get("dpo")
    cfg = recipes.resolve(
        recipe,
        None,
        ["optim.lr=2e-3"],
        {
            "flag_batch_size": 2,
            "flag_num_epochs": 7,
            "flag_learning_rate": 1e-5,
            "flag_output_dir": "out",
            "flag_backend": "gloo",
            "flag_beta": 0.5,
        },
    )
    assert (cfg.training.batch_size, cfg.training.epochs) == (2, 7)
    assert cfg.optim.lr == 2e-3  # --set wins over flags
    assert (cfg.checkpoint.dir, cfg.ddp.backend, cfg.recipe["beta"]) == ("out", "gloo", 0.5)


def _cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**base_env(), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "ddp", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_cli_list_and_errors() -> None:
    out = _cli("--list")
    assert out.returncode == 0 and "uniref50" in out.stdout and "dpo" in out.stdout
    bad = _cli("dpo", "--set", "optim.lrr=1")
    assert bad.returncode == 2
    assert (
        bad.stderr.strip().splitlines() == [bad.stderr.strip()]
        and "ddp: error: unknown key 'optim.lrr'; did you mean 'optim.lr'?" in bad.stderr
    )
    assert _cli("dpoo").returncode == 2


def test_cli_under_torchrun_two_ranks(tmp_path: Path) -> None:
    """The same command under torchrun: 2 Gloo ranks, one checkpoint dir, final export."""
    cmd = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "ddp",
        "dpo",
        "--output_dir",
        str(tmp_path),
        "--num_epochs",
        "1",
        "--batch_size",
        "8",
        "--backend",
        "gloo",
    ]
    out = subprocess.run(
        [sys.executable, *cmd], capture_output=True, text=True, timeout=120, env=base_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world=2 effective batch=16" in out.stdout
    assert (tmp_path / "final" / "model.pt").is_file()
    assert (tmp_path / "latest").is_file()
