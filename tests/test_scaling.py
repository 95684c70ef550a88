"""One LR/warmup scaling rule: ``hpc scale`` (login side) and ``TrainConfig`` (the
trainer) print and apply the same numbers, checked against seed 004's table.

Seed 004 (the UniRef50 DDP guide) tunes lr 5e-5 and warmup 5000 on one GPU with
batch 16 x accum 4 and scales them linearly to 2, 4 and 8 GPUs::

    # 2 GPUs: lr = 1e-4  (5e-5 x 2)     # 2 GPUs: 16 x 4 x 2 = 128    # 2 GPUs: 10000 steps
    # 4 GPUs: lr = 2e-4  (5e-5 x 4)     # 4 GPUs: 16 x 4 x 4 = 256    # 4 GPUs: 20000 steps
    # 8 GPUs: lr = 4e-4  (5e-5 x 8)     # 8 GPUs: 16 x 4 x 8 = 512    # 8 GPUs: 40000 steps

Its "8 GPUs configuration" is less aggressive: batch 12 x accum 4 (384), lr 3e-4
(5e-5 x 6) and warmup 30000 (5000 x 6), which is ``cap:6``: linear until the factor
reaches 6, then flat. Its "custom scaling" ``base_lr * min(num_gpus, 4)`` is ``cap:4``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddp import scaling
from ddp.config import TrainConfig
from ddp.errors import ConfigError
from hpc.cli import main as hpc_main

REPO = Path(__file__).resolve().parents[1]

# (rule, batch_size, gpus) -> (effective batch, lr, warmup), transcribed from seed 004.
SEED_004 = [
    ("linear", 16, 1, 64, 5e-5, 5000),
    ("linear", 16, 2, 128, 1e-4, 10000),
    ("linear", 16, 4, 256, 2e-4, 20000),
    ("linear", 16, 8, 512, 4e-4, 40000),
    ("cap:6", 12, 8, 384, 3e-4, 30000),  # the guide's "8 GPUs configuration"
    ("cap:4", 16, 8, 512, 2e-4, 20000),  # its "custom scaling": min(num_gpus, 4)
]


def _hpc_scale_rows(
    capsys: pytest.CaptureFixture[str], *args: str
) -> dict[int, tuple[int, float, int]]:
    """``hpc scale`` through the real CLI; its printed table as {gpus: (batch, lr, warmup)}."""
    assert hpc_main(["scale", *args]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = re.findall(r"[0-9][0-9.e+-]*", line)
        if len(cells) == 5 and "│" in line:
            gpus, batch, _factor, lr, warmup = cells
            rows[int(gpus)] = (int(batch), float(lr), int(warmup))
    return rows


@pytest.mark.parametrize(("rule", "batch", "gpus", "eff", "lr", "warmup"), SEED_004)
def test_seed_004_table_from_hpc_scale_and_train_config(
    rule: str,
    batch: int,
    gpus: int,
    eff: int,
    lr: float,
    warmup: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    printed = _hpc_scale_rows(
        capsys,
        "--gpus",
        str(gpus),
        "--rule",
        rule,
        "--base-lr",
        "5e-5",
        "--base-warmup",
        "5000",
        "--batch-size",
        str(batch),
        "--accum",
        "4",
    )
    assert printed[gpus][0] == eff and printed[gpus][2] == warmup
    assert printed[gpus][1] == pytest.approx(lr)
    cfg = TrainConfig.from_dict(
        {
            "training": {"batch_size": batch, "accum": 4},
            "optim": {"lr": 5e-5, "warmup_steps": 5000},
            "scaling": {"rule": rule, "base_world_size": 1, "scale_warmup": True},
        }
    )
    assert cfg.effective_batch(gpus) == eff
    assert cfg.scaled_lr(gpus) == pytest.approx(lr)
    assert cfg.scaled_warmup(gpus) == warmup


@pytest.mark.parametrize("rule", ["none", "linear", "sqrt", "cap:1", "cap:3", "cap:2.5"])
@pytest.mark.parametrize("base", [1, 2, 3])
def test_both_sides_agree_at_every_size(rule: str, base: int) -> None:
    """Same rule, same base: hpc's table and TrainConfig give identical numbers (not approx)."""
    from hpc.scale import table

    cfg = TrainConfig.from_dict(
        {
            "training": {"batch_size": 3, "accum": 2},
            "optim": {"lr": 1e-3, "warmup_steps": 7},
            "scaling": {"rule": rule, "base_world_size": base, "scale_warmup": True},
        }
    )
    for row in table(16, rule, 1e-3, 7, 3, 2, base_gpus=base):
        assert (row.factor, row.lr, row.warmup, row.effective_batch) == (
            cfg.scale_factor(row.gpus),
            cfg.scaled_lr(row.gpus),
            cfg.scaled_warmup(row.gpus),
            cfg.effective_batch(row.gpus),
        )


def test_cap_caps_the_factor_not_the_gpu_count() -> None:
    """With a base of 2 ranks, cap:2 stops growing at 4 ranks (factor 2), on both sides."""
    from hpc.scale import table

    assert [r.factor for r in table(16, "cap:2", 1.0, 0, 1, 1, base_gpus=2)] == [
        0.5,
        1.0,
        2.0,
        2.0,
        2.0,
    ]
    assert scaling.scale_factor("cap:2", 16, 2) == 2.0


@pytest.mark.parametrize("rule", ["cap:0", "cap:0.5", "cap:", "cap:x", "cube", "cap:-1"])
def test_bad_rules_refused_alike(rule: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="scaling.rule"):
        TrainConfig.from_dict({"scaling": {"rule": rule}})
    assert hpc_main(["scale", "--gpus", "8", "--base-lr", "1e-4", "--rule", rule]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hpc: error: rule: {rule!r}"), err


def test_hpc_scale_base_gpus_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``--base-gpus`` is TrainConfig's ``scaling.base_world_size``: same numbers."""
    rows = _hpc_scale_rows(
        capsys,
        "--gpus",
        "8",
        "--rule",
        "cap:2",
        "--base-lr",
        "1e-3",
        "--base-warmup",
        "100",
        "--base-gpus",
        "2",
    )
    cfg = TrainConfig.from_dict(
        {
            "optim": {"lr": 1e-3, "warmup_steps": 100},
            "scaling": {"rule": "cap:2", "base_world_size": 2, "scale_warmup": True},
        }
    )
    assert sorted(rows) == [1, 2, 4, 8]
    for gpus, (_, lr, warmup) in rows.items():
        assert lr == pytest.approx(cfg.scaled_lr(gpus)) and warmup == cfg.scaled_warmup(gpus)
    assert rows[8][1:] == (2e-3, 200)


def test_hpc_scale_bad_base_gpus_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert hpc_main(["scale", "--gpus", "8", "--base-lr", "1e-4", "--base-gpus", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hpc: error: base-gpus: 0 is not allowed; allowed: a whole number >= 1"]


def test_shared_module_and_hpc_scale_import_no_torch() -> None:
    """The shared rule is standard library only, so ``hpc scale`` stays torch-free."""
    code = (
        "import sys; from hpc.cli import main; "
        "rc = main(['scale', '--gpus', '4', '--base-lr', '1e-3']); "
        "assert rc == 0, rc; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')]; "
        "print('LOADED', bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "LOADED []" in out, out
    tree = ast.parse((REPO / "src" / "ddp" / "scaling.py").read_text())
    imports = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    } | {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert imports <= {"__future__", "math", "re", "dataclasses"}, imports


# ---- scaling.by: batch (seed 003's formula) -------------------------------------------
# Seed 003 (Crowd-BT): "New LR = Base LR x (Effective Batch Size / Base Batch Size)";
# "base configuration uses batch_size=16 and lr=1e-4 ... 4 GPUs with batch_size=16 per
# GPU: Effective batch size: 16 x 4 = 64; Scaled LR: 1e-4 x (64 / 16) = 4e-4".
SEED_003 = [  # (gpus, batch per GPU, accum) -> (effective batch, lr)
    (1, 16, 1, 16, 1e-4),
    (4, 16, 1, 64, 4e-4),  # the worked example
    (2, 32, 1, 64, 4e-4),  # a bigger per-GPU batch counts too (by world would say 2e-4)
    (1, 8, 2, 16, 1e-4),  # and so does accumulation
]


@pytest.mark.parametrize(("gpus", "batch", "accum", "eff", "lr"), SEED_003)
def test_seed_003_by_batch_from_hpc_scale_and_train_config(
    gpus: int,
    batch: int,
    accum: int,
    eff: int,
    lr: float,
    capsys: pytest.CaptureFixture[str],
) -> None:
    printed = _hpc_scale_rows(
        capsys,
        "--gpus",
        str(gpus),
        "--rule",
        "linear",
        "--by",
        "batch",
        "--base-batch",
        "16",
        "--base-lr",
        "1e-4",
        "--batch-size",
        str(batch),
        "--accum",
        str(accum),
    )
    assert printed[gpus][0] == eff and printed[gpus][1] == pytest.approx(lr)
    cfg = TrainConfig.from_dict(
        {
            "training": {"batch_size": batch, "accum": accum},
            "optim": {"lr": 1e-4},
            "scaling": {"rule": "linear", "by": "batch", "base_batch_size": 16},
        }
    )
    assert cfg.effective_batch(gpus) == eff
    assert cfg.scaled_lr(gpus) == pytest.approx(lr)


def test_by_batch_rules_apply_to_the_batch_ratio_on_both_sides() -> None:
    """sqrt and cap:N act on effective/base alike; identical numbers from both sides."""
    from hpc.scale import table

    for rule in ("none", "sqrt", "cap:2", "linear"):
        cfg = TrainConfig.from_dict(
            {
                "training": {"batch_size": 8, "accum": 1},
                "optim": {"lr": 1e-3, "warmup_steps": 10},
                "scaling": {
                    "rule": rule,
                    "by": "batch",
                    "base_batch_size": 4,
                    "scale_warmup": True,
                },
            }
        )
        for row in table(8, rule, 1e-3, 10, 8, 1, by="batch", base_batch=4):
            assert (row.factor, row.lr, row.warmup) == (
                cfg.scale_factor(row.gpus),
                cfg.scaled_lr(row.gpus),
                cfg.scaled_warmup(row.gpus),
            )
    assert scaling.factor_by("sqrt", "batch", 8, effective=64, base_batch_size=16) == 2.0
    assert scaling.factor_by("cap:2", "batch", 8, effective=64, base_batch_size=16) == 2.0
    # by world ignores the batch: 4 GPUs of 32 against a base of 1 GPU is 4, not 8
    assert scaling.factor_by("linear", "world", 4, effective=128, base_batch_size=16) == 4.0


def test_by_batch_without_a_base_batch_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"^scaling.base_batch_size: 0 is not allowed"):
        TrainConfig.from_dict({"scaling": {"rule": "linear", "by": "batch"}})
    with pytest.raises(ConfigError, match=r"^scaling.base_batch_size: 16 .* with by: world"):
        TrainConfig.from_dict({"scaling": {"rule": "linear", "base_batch_size": 16}})
    with pytest.raises(ConfigError, match=r"^scaling.by: 'samples'"):
        TrainConfig.from_dict({"scaling": {"by": "samples"}})
    assert hpc_main(["scale", "--gpus", "4", "--base-lr", "1e-4", "--by", "batch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hpc: error: base-batch: 0 is not allowed"), err
    # a base batch without --by batch would be silently ignored: refused instead
    assert hpc_main(["scale", "--gpus", "4", "--base-lr", "1e-4", "--base-batch", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "base-batch: 16 is used only with --by batch" in err[0], err
