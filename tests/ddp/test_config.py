"""TrainConfig: YAML sections, --set overrides, validation messages, scaling rules."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp.config import TrainConfig, check_free_section, parse_assignment, scale_factor
from ddp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_sections() -> None:
    cfg = TrainConfig()
    assert cfg.precision == "fp32"
    assert cfg.preemption.signals == ["SIGUSR1", "SIGTERM"]
    assert cfg.logging.wandb.mode == "offline"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"optim": {"lrr": 1}}, "did you mean 'optim.lr'"),
        ({"trainig": {}}, "did you mean 'training'"),
        ({"training": {"bach_size": 4}}, "did you mean 'training.batch_size'"),
        ({"logging": {"wandb": {"projet": "x"}}}, "did you mean 'logging.wandb.project'"),
    ],
)
def test_unknown_key_names_nearest(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as exc:
        TrainConfig.from_dict(data)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"training": {"batch_size": "big"}}, "training.batch_size: expected an integer"),
        ({"training": {"batch_size": 0}}, "training.batch_size"),
        ({"training": {"batch_size": 2.5}}, "expected an integer"),
        ({"optim": {"lr": "fast"}}, "optim.lr: expected a number"),
        ({"optim": {"lr": -1}}, "optim.lr"),
        ({"optim": {"name": "adam"}}, "did you mean 'adamw'"),
        ({"optim": {"schedule": "cosin"}}, "did you mean 'cosine'"),
        ({"precision": "fp8"}, "precision: 'fp8' is not one of fp32, bf16, fp16"),
        ({"scaling": {"rule": "lineer"}}, "did you mean 'linear'"),
        ({"scaling": {"rule": "cap:x"}}, "scaling.rule"),
        ({"ddp": {"static_graph": "maybe"}}, "expected true or false"),
        ({"preemption": {"signals": ["SIGTREM"]}}, "did you mean 'SIGTERM'"),
        ({"memory": {"max_memory_fraction": 1.5}}, "max_memory_fraction"),
        ({"phases": [{"epochs": 1, "lrate": 1}]}, "did you mean 'phases.0.lr'"),
        ({"training": 3}, "training: expected a mapping"),
    ],
)
def test_bad_values(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_dict(data)


def test_scientific_notation_strings_are_floats(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-4\n  weight_decay: 5E-2\ntraining:\n  max_samples: 1e3\n")
    cfg = TrainConfig.from_yaml(path)
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.weight_decay == 0.05
    assert cfg.training.max_samples == 1000


def test_yaml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        TrainConfig.from_yaml(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TrainConfig.from_yaml(tmp_path / "bad.yaml")


def test_set_overrides_are_typed() -> None:
    cfg = TrainConfig().override(
        [
            "optim.lr=3e-4",
            "training.max_steps=10",
            "ddp.static_graph=true",
            "preemption.signals=[SIGTERM]",
            "checkpoint.dir=null",
            "logging.wandb.project=demo",
            "model.width=128",
            "precision=bf16",
        ]
    )
    assert cfg.optim.lr == 3e-4
    assert cfg.training.max_steps == 10
    assert cfg.ddp.static_graph is True
    assert cfg.preemption.signals == ["SIGTERM"]
    assert cfg.checkpoint.dir is None
    assert cfg.logging.wandb.project == "demo"
    assert cfg.model == {"width": 128}
    assert cfg.precision == "bf16"


def test_set_parsing_errors() -> None:
    assert parse_assignment("a.b=x=y") == ("a.b", "x=y")
    with pytest.raises(ConfigError, match="expected section.key=value"):
        TrainConfig().override(["optim.lr"])
    with pytest.raises(ConfigError, match="did you mean 'optim.lr'"):
        TrainConfig().override(["optim.lr_=1"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        TrainConfig().override(["precision.x=1"])


def test_phases_and_roundtrip() -> None:
    cfg = TrainConfig.from_dict(
        {"phases": [{"name": "p1", "epochs": 1, "lr": "2e-5"}, {"epochs": 3, "skip": True}]}
    )
    assert cfg.phases[0].lr == 2e-5 and cfg.phases[1].skip
    cfg2 = cfg.override(["phases.1.skip=false"])
    assert not cfg2.phases[1].skip
    assert TrainConfig.from_dict(cfg2.to_dict()) == cfg2


def test_free_section_checked_against_defaults() -> None:
    cfg = TrainConfig.from_dict({"model": {"d_model": "128"}})
    assert check_free_section(cfg, "model", {"d_model": 64, "dropout": 0.0}) == {
        "d_model": 128,
        "dropout": 0.0,
    }
    with pytest.raises(ConfigError, match="did you mean 'model.d_model'"):
        check_free_section(
            TrainConfig.from_dict({"model": {"dmodel": 1}}), "model", {"d_model": 64}
        )
    with pytest.raises(ConfigError, match="model.d_model: expected an integer"):
        check_free_section(
            TrainConfig.from_dict({"model": {"d_model": "x"}}), "model", {"d_model": 64}
        )


@pytest.mark.parametrize(
    ("rule", "world", "base", "factor"),
    [
        ("none", 8, 1, 1.0),
        ("linear", 8, 1, 8.0),
        ("linear", 8, 2, 4.0),
        ("linear", 1, 4, 0.25),
        ("sqrt", 4, 1, 2.0),
        ("sqrt", 8, 2, 2.0),
        ("cap:4", 8, 1, 4.0),
        ("cap:4", 2, 1, 2.0),
        ("cap:2.5", 12, 1, 2.5),
    ],
)
def test_scaling_rules(rule: str, world: int, base: int, factor: float) -> None:
    assert scale_factor(rule, world, base) == pytest.approx(factor)
    cfg = TrainConfig.from_dict(
        {
            "optim": {"lr": 1e-4, "warmup_steps": 100},
            "scaling": {"rule": rule, "base_world_size": base, "scale_warmup": True},
        }
    )
    assert cfg.scaled_lr(world) == pytest.approx(1e-4 * factor)
    assert cfg.scaled_warmup(world) == round(100 * factor)


def test_effective_batch() -> None:
    cfg = TrainConfig.from_dict({"training": {"batch_size": 16, "accum": 4}})
    assert cfg.effective_batch(8) == 512
    assert cfg.scaled_warmup(8) == cfg.optim.warmup_steps  # scale_warmup off by default


@given(st.integers(1, 1024), st.integers(1, 64))
def test_sqrt_is_between_none_and_linear(world: int, base: int) -> None:
    s = scale_factor("sqrt", world, base)
    lin = scale_factor("linear", world, base)
    assert math.isclose(s * s, lin, rel_tol=1e-9)
    assert min(1.0, lin) - 1e-12 <= s <= max(1.0, lin) + 1e-12


@pytest.mark.parametrize("name", ["uniref50", "dpo"])
def test_shipped_configs_are_valid(name: str) -> None:
    from ddp import recipes

    cfg = recipes.resolve(recipes.get(name), ROOT / "configs" / f"{name}.yaml")
    assert cfg.checkpoint.resume == "auto"


def test_relative_checkpoint_dir_goes_under_the_run_directory(monkeypatch, tmp_path):
    """`hpc submit` exports HPC_RUN_DIR: a relative checkpoint.dir lands in the run directory."""
    from ddp.config import TrainConfig

    monkeypatch.setenv("HPC_RUN_DIR", str(tmp_path))
    cfg = TrainConfig.from_dict({"checkpoint": {"dir": "ck"}})
    assert cfg.checkpoint.dir == str(tmp_path / "ck")
    assert TrainConfig.from_dict({"checkpoint": {"dir": "/abs/ck"}}).checkpoint.dir == "/abs/ck"
    assert cfg.override(["training.epochs=2"]).checkpoint.dir == str(tmp_path / "ck")
    monkeypatch.delenv("HPC_RUN_DIR")
    assert TrainConfig.from_dict({"checkpoint": {"dir": "ck"}}).checkpoint.dir == "ck"


# ---- issue 24: numbers past what the libraries they reach can hold ---------------------
@pytest.mark.parametrize(
    ("assignment", "allowed"),
    [
        ("ddp.timeout_s=1e300", "at most 31536000"),
        ("preemption.grace_s=1e300", "at most|to 31536000"),
        ("training.seed=1e300", "from -9223372036854775808 to 9223372036854775807"),
        ("training.seed=-1e300", "out of range"),
        ("training.batch_size=1e300", "out of range"),
        ("training.batch_size=9223372036854775807", "from 1 to 2147483647"),
        ("training.accum=4294967296", "from 1 to 2147483647"),
        ("training.epochs=1e300", "out of range"),
        ("training.max_steps=1e19", "out of range"),
        ("checkpoint.keep_last=1e300", "out of range"),
        ("optim.lr=1e300", "float32"),
        ("optim.betas=[2, 0.9]", r"two numbers in \[0, 1\)"),
        ("optim.momentum=-1", ">= 0"),
        ("optim.min_lr_ratio=-5", r"\[0, 1\]"),
        ("optim.min_lr_ratio=2", r"\[0, 1\]"),
        ("ddp.bucket_cap_mb=1e300", "at most 1e\\+12"),
    ],
)
def test_numbers_that_would_overflow_later_are_one_line(assignment: str, allowed: str) -> None:
    """Each of these passed the old checks and failed after start-up: an OverflowError,
    torch's "Overflow when unpacking long", a C++ type error, a silently negative LR."""
    with pytest.raises(ConfigError, match=allowed) as exc:
        TrainConfig().override([assignment])
    assert "\n" not in str(exc.value) and assignment.split("=")[0] in str(exc.value)


def _int_fields() -> list[str]:
    """Every integer key of the config (sections and their dataclasses, phases too)."""
    import dataclasses
    import typing

    out = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if typing.get_origin(tp) is list:  # phases: its first element
                (item,) = typing.get_args(tp)
                if dataclasses.is_dataclass(item):
                    walk(item, f"{prefix}{f.name}.0.")
                continue
            args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
            if dataclasses.is_dataclass(args[0]):
                walk(args[0], f"{prefix}{f.name}.")
            elif args[0] is int:
                out.append(f"{prefix}{f.name}")

    walk(TrainConfig, "")
    return out


@pytest.mark.parametrize("key", _int_fields())
def test_no_integer_key_takes_a_number_beyond_64_bits(key: str) -> None:
    base = TrainConfig.from_dict({"phases": [{"name": "one"}]})
    for value in ("1e300", str(2**64), str(-(2**64))):
        with pytest.raises(ConfigError, match="out of range|allowed|not allowed") as exc:
            base.override([f"{key}={value}"])
        assert key in str(exc.value)


def test_the_collective_timeout_is_bounded_however_it_is_given(monkeypatch) -> None:
    from datetime import timedelta

    from ddp.dist import _timeout

    for value in (1e300, timedelta.max, float("nan"), 0, "30"):
        with pytest.raises(ConfigError, match="at most 31536000"):
            _timeout(value)  # type: ignore[arg-type]
    monkeypatch.setenv("DDP_TIMEOUT", "1e300")
    with pytest.raises(ConfigError, match="at most 31536000"):
        _timeout(None)
    assert _timeout(31536000).total_seconds() == 31536000


def test_python_m_ddp_with_a_huge_timeout_is_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.ddp._launch import base_env

    proc = subprocess.run(
        [sys.executable, "-m", "ddp", "uniref50", "--set", "ddp.timeout_s=1e300"],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "ddp.timeout_s" in lines[0], proc.stderr
