"""Seed 004's configs as written (issue 26 items 2, 3 and 6).

tests/ddp/data/seed004/ holds the seed guide's own YAML blocks, copied verbatim: its 2-,
4- and 8-GPU configs (already-scaled lr and warmup) and its memory/performance/monitoring
keys. They must give exactly the seed's lr and warmup at those world sizes (the 8-GPU
world is the same arithmetic the Trainer runs: ``TrainConfig.scaled_lr(world)``), their
aliases must map onto the canonical keys with one note each, and a real 2-rank run from the
2-GPU config must log the seed's ``ddp/*`` values and write samples at the frequency.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from ddp import config_load as ddp_config
from ddp import recipes
from ddp.errors import ConfigError
from ddp.loggers import layer_of, run_info
from tests.ddp import _launch

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "tests" / "ddp" / "data" / "seed004"

# (file, GPUs, the seed's lr, the seed's warmup, the seed's effective batch)
SEED_TABLE = [
    ("gpus2.yaml", 2, 1e-4, 10000, 128),
    ("gpus4.yaml", 4, 2e-4, 20000, 256),
    ("gpus8.yaml", 8, 3e-4, 30000, 384),
]


def _resolve(path: Path | None, *sets: str):
    return recipes.resolve(recipes.get("uniref50"), path, list(sets))


@pytest.mark.parametrize(("name", "world", "lr", "warmup", "batch"), SEED_TABLE)
def test_the_seeds_gpu_configs_give_the_seeds_lr_and_warmup(
    name: str, world: int, lr: float, warmup: int, batch: int
) -> None:
    cfg = _resolve(SEED / name)
    assert cfg.scaling.rule == "none"  # the file sets lr/warmup and names no rule: final
    assert cfg.scaled_lr(world) == pytest.approx(lr, rel=1e-12)
    assert cfg.scaled_warmup(world) == warmup
    assert cfg.effective_batch(world) == batch
    info = run_info(cfg, world)  # what W&B and metrics.jsonl get
    assert info == {
        "ddp/world_size": world,
        "ddp/effective_batch_size": batch,
        "ddp/scaled_lr": pytest.approx(lr),
        "ddp/scaled_warmup": warmup,
    }


def test_the_recipes_own_config_scales_the_seeds_base_values() -> None:
    """configs/uniref50.yaml names scaling.rule: linear, so its lr/warmup are the seed's base
    (5e-5, 5000) and give the seed's table at 2 and 4 GPUs: the same numbers either way."""
    cfg = _resolve(ROOT / "configs" / "uniref50.yaml")
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.scaling.rule) == (5e-5, 5000, "linear")
    for _, world, lr, warmup, batch in SEED_TABLE[:2]:
        assert cfg.scaled_lr(world) == pytest.approx(lr)
        assert cfg.scaled_warmup(world) == warmup
        assert cfg.effective_batch(world) == batch


def test_recipe_defaults_are_the_seeds() -> None:
    cfg = _resolve(None)
    t, o, m = cfg.training, cfg.optim, cfg.model
    assert (t.batch_size, t.accum, o.lr, o.warmup_steps) == (16, 4, 5e-5, 5000)
    assert (m["d_model"], m["n_layers"], m["n_heads"], m["loss"]) == (768, 12, 12, "sedd")
    assert (cfg.precision, cfg.memory.max_memory_fraction, cfg.data.num_workers) == (
        "bf16",
        0.85,
        4,
    )
    assert cfg.monitoring.sample_frequency == 5000
    assert cfg.scaled_lr(8) == pytest.approx(4e-4)  # the seed's linear table: 5e-5 x 8


def test_the_seeds_aliases_map_to_the_canonical_keys_each_noted_once() -> None:
    ddp_config._LOGGED.clear()
    cfg = _resolve(SEED / "advanced.yaml")
    assert cfg.precision == "bf16"  # memory.mixed_precision: True
    assert cfg.memory.max_memory_fraction == 0.85  # memory.max_memory_per_gpu
    assert cfg.data.num_workers == 4  # training.num_workers
    assert cfg.monitoring.sample_frequency == 5000
    assert (cfg.monitoring.log_gradients, cfg.monitoring.log_weights) == (False, False)
    cfg = _resolve(SEED / "gpus2.yaml", "optim.warmup=7")  # --set takes the alias too
    assert cfg.optim.warmup_steps == 7
    logger, seen = logging.getLogger("ddp"), []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.INFO)
    logger.disabled = False
    try:
        ddp_config.log_config_notes()
        _resolve(SEED / "advanced.yaml")
        _resolve(SEED / "hidden512.yaml", "model.n_heads=8")
        ddp_config.log_config_notes()  # the same notes again: not logged twice
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    text = seen
    for alias, canonical in [
        ("optim.warmup", "optim.warmup_steps"),
        ("memory.mixed_precision", "precision"),
        ("memory.max_memory_per_gpu", "memory.max_memory_fraction"),
        ("training.num_workers", "data.num_workers"),
        ("model.hidden_size", "model.d_model"),
    ]:
        hits = [m for m in text if f"{alias} is the seed's name for {canonical}" in m]
        assert len(hits) == 1, (alias, text)
    for name in ("gpus2.yaml", "gpus4.yaml", "gpus8.yaml"):  # each file: its values are final
        assert sum(f"{name} sets optim.lr" in m and "final" in m for m in text) == 1, text


def test_the_seeds_hidden_size_512_is_d_model() -> None:
    """The seed's OOM advice (hidden_size: 512) as written keeps SEDD small's 12 heads,
    which do not divide 512: one line naming n_heads; with 8 heads (64 wide, as SEDD's)
    it is d_model 512."""
    with pytest.raises(ConfigError, match="model.n_heads: 12 does not divide model.d_model: 512"):
        _resolve(SEED / "hidden512.yaml")
    assert _resolve(SEED / "hidden512.yaml", "model.n_heads=8").model["d_model"] == 512


def test_an_alias_and_its_key_that_disagree_are_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "both.yaml"
    bad.write_text("optim:\n  warmup: 10\n  warmup_steps: 20\n")
    with pytest.raises(ConfigError, match="optim.warmup: 10 and optim.warmup_steps: 20 disagree"):
        _resolve(bad)
    proc = subprocess.run(
        [sys.executable, "-m", "ddp", "uniref50", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_launch.base_env(),
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "disagree" in proc.stderr


def test_layer_names_group_parameters_by_block() -> None:
    assert layer_of("module.blocks.3.attn.qkv.weight") == "blocks.3"
    assert layer_of("embed.weight") == "embed"
    assert layer_of("_orig_mod.sigma.mlp.0.bias") == "sigma.mlp.0"


def test_two_ranks_from_the_seeds_2gpu_config_log_and_sample(tmp_path: Path) -> None:
    """A real 2-rank Gloo run from the seed's 2-GPU file (a tiny model set on top): the first
    metrics.jsonl record holds the seed's ddp/* values, samples are written at exactly the
    frequency, and per-layer norms come with the log points."""
    out = tmp_path / "run"
    args = [
        "-m",
        "ddp",
        "uniref50",
        "--config",
        str(SEED / "gpus2.yaml"),
        "--work_dir",
        str(out),
        "--set",
        "training.batch_size=4",
        "training.accum=1",
        "training.max_steps=4",
        "model.d_model=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.cond_dim=16",
        "model.max_len=32",
        "model.dropout=0",
        "precision=fp32",
        "data.num_workers=0",
        "memory.max_memory_fraction=null",
        "logging.every_n_steps=2",
        "logging.progress=plain",
        "monitoring.sample_frequency=2",
        "monitoring.num_samples=3",
        "monitoring.sample_steps=4",
        "monitoring.log_gradients=true",
        "monitoring.log_weights=true",
    ]
    results = _launch.run(args, world=2, timeout=240)
    for rank, (rc, o, e) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{o[-2000:]}\n{e[-3000:]}"
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["kind"] == "run"
    assert recs[0]["ddp/world_size"] == 2 and recs[0]["ddp/effective_batch_size"] == 8
    assert recs[0]["ddp/scaled_lr"] == pytest.approx(1e-4)  # the seed's, not 2e-4
    assert recs[0]["ddp/scaled_warmup"] == 10000  # the seed's, not 20000
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step_2.fasta", "step_4.fasta"]
    fasta = (out / "samples" / "step_4.fasta").read_text().splitlines()
    assert len(fasta) == 6 and all(h.startswith(">sample_") for h in fasta[::2])
    assert all(set(q) <= set("ACDEFGHIKLMNPQRSTVWYX") for q in fasta[1::2])
    samples = [r for r in recs if r["kind"] == "samples"]
    assert [r["step"] for r in samples] == [2, 4] and "len_mean" in samples[0]
    assert (
        abs(sum(v for k, v in samples[0].items() if k.startswith("aa_")) - 1) < 1e-6
        or samples[0]["len_mean"] == 0
    )
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        for kind in ("grad_norm", "weight_norm"):
            layers = {k for k in r if k.startswith(kind + "/")}
            assert {f"{kind}/blocks.0", f"{kind}/embed", f"{kind}/out"} <= layers, r
            assert all(r[k] >= 0 for k in layers)
        assert r["weight_norm/blocks.0"] > 0
    console = results[0][1]
    assert console.count("optim.warmup is the seed's name for optim.warmup_steps") == 1
    assert "samples step 2:" in console and "[rank 1]" not in console


def test_wandb_config_holds_the_scaled_values(tmp_path: Path, monkeypatch) -> None:
    """Item 6: the W&B run's config (not only the console) has the ddp/* values; linear rule
    at 2 ranks, so the scaled lr and warmup differ from the config's base values."""
    pytest.importorskip("wandb", reason="wandb is in the test extra")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {
        "training": {"batch_size": 4, "accum": 3, "epochs": 1},
        "optim": {"name": "sgd", "lr": 0.0125, "warmup_steps": 7},
        "scaling": {"rule": "linear", "scale_warmup": True},
        "checkpoint": {"dir": str(tmp_path / "ck")},
        "logging": {
            "every_n_steps": 1,
            "progress": "off",
            "wandb": {"project": "hpc-ddp-test", "mode": "offline"},
        },
    }
    results = _launch.run(
        ["tests/ddp/_train_worker.py", json.dumps({"config": cfg, "n": 16})], world=2, timeout=120
    )
    for rank, (rc, o, e) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{o[-2000:]}\n{e[-3000:]}"
    (run,) = list((tmp_path / "wandb").glob("offline-run-*"))
    (history,) = run.glob("run-*.wandb")
    data = history.read_bytes()
    for key, value in (
        ("ddp/world_size", b"2"),
        ("ddp/effective_batch_size", b"24"),
        ("ddp/scaled_lr", b"0.025"),
        ("ddp/scaled_warmup", b"14"),
    ):
        assert key.encode() in data, key
        at = data.index(key.encode())
        assert value in data[at : at + 80], (key, data[at : at + 80])
    first = json.loads((tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["kind"], first["ddp/scaled_lr"], first["ddp/scaled_warmup"]) == ("run", 0.025, 14)


def test_layer_norms_add_no_host_reads_between_log_points(tmp_path: Path) -> None:
    """monitoring.log_gradients/log_weights: still no host read of a tensor between log
    points (the harness of test_trainer_sync), and each log point still reads once."""
    spec = {
        "out": str(tmp_path),
        "n": 512,
        "start": 3,
        "stop": 13,
        "config": {
            "training": {"batch_size": 4, "epochs": 1, "max_steps": 20},
            "optim": {"name": "sgd", "lr": 0.01},
            "checkpoint": {"dir": None},
            "logging": {"every_n_steps": 1000, "progress": "off"},
            "monitoring": {"log_gradients": True, "log_weights": True},
        },
    }
    results = _launch.run(["tests/ddp/_sync_worker.py", json.dumps(spec)], world=2, timeout=120)
    for rank, (rc, o, e) in enumerate(results):
        assert rc == 0, f"rank {rank}: {o[-2000:]}\n{e[-3000:]}"
    for rank in range(2):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec["reads"] == 0, rec["where"]
    spec["config"]["logging"]["every_n_steps"] = 5  # two log points in the counted steps
    results = _launch.run(["tests/ddp/_sync_worker.py", json.dumps(spec)], world=2, timeout=120)
    assert all(rc == 0 for rc, _, _ in results), results
    assert json.loads((tmp_path / "rank0.json").read_text())["reads"] == 2  # one per log point
