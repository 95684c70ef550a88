"""dpo from a pretrained (here: tiny, locally built) causal LM, on 2 Gloo ranks.

What a seed-001 user relies on: the reference never moves (bit-identical before and
after training, and on every rank), the first step's loss is ln 2 (policy == reference),
each loss variant is TRL's formula (checked against a hand computation on unpadded
sequences), a record that names a PDB file trains, and the seed's progress lines print.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the test extra installs it (setup.cfg)
pytest.importorskip("Bio")

import torch

from tests.ddp import _launch
from tests.ddp.dpo_fixtures import make_tiny_lm, write_pairs, write_pdb

os.environ["HF_HUB_OFFLINE"] = "1"  # never download; subprocesses inherit it


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_lm(tmp_path_factory.mktemp("lm") / "tiny-gpt2")


def _env() -> dict[str, str]:
    return {**_launch.base_env(), "HF_HUB_OFFLINE": "1"}


DRIVER = r"""
import hashlib, json, sys
import ddp
from ddp import recipes
from ddp.trainer import Trainer

def digest(module):
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode()); h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()

out = sys.argv[1]
recipe = recipes.get("dpo")
cfg = recipes.resolve(recipe, None, sys.argv[2:])
ctx = ddp.init(backend="gloo")
built = recipe.build(cfg)
ref = built.reference.model
ref_before, policy_before = digest(ref), digest(built.model)
losses = []
def step(model, batch):
    res = built.step_fn(model, batch)
    losses.append(float(res["loss"]))
    return res
trainer = Trainer(built.model, built.train_data, cfg, step, built.eval_data, built.eval_fn,
                  built.collate_fn)
summary = trainer.fit()
wrapped_params = {id(p) for p in trainer.wrapped.parameters()}
json.dump({
    "ref_before": ref_before, "ref_after": digest(ref),
    "policy_before": policy_before, "policy_after": digest(ddp.unwrap(trainer.wrapped)),
    "ref_in_ddp": any(id(p) in wrapped_params for p in ref.parameters()),
    "ref_training": ref.training, "ref_grad": any(p.requires_grad for p in ref.parameters()),
    "wrapped": type(trainer.wrapped).__name__, "first_loss": losses[0], "steps": summary["steps"],
}, open(f"{out}/rank{ctx.rank}.json", "w"))
ddp.shutdown()
"""


def test_reference_frozen_and_first_loss_ln2_on_two_ranks(lm: Path, tmp_path: Path) -> None:
    data = write_pairs(tmp_path / "pairs.json", 12)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    sets = [
        f"model.name_or_path={lm}",
        f"recipe.train_data={data}",
        "recipe.val_fraction=0.25",
        f"checkpoint.dir={tmp_path / 'run'}",
        "training.epochs=2",
        "optim.lr=1e-2",
        "training.batch_size=2",
        "logging.progress=off",
    ]
    results = _launch.run([str(driver), str(tmp_path), *sets], world=2, timeout=240)
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["wrapped"] == "DistributedDataParallel"
    for r in (r0, r1):
        assert r["ref_before"] == r["ref_after"]  # bit-identical after training
        assert not r["ref_in_ddp"] and not r["ref_training"] and not r["ref_grad"]
        assert r["policy_after"] != r["policy_before"]  # the policy did train
        assert r["first_loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert r["steps"] > 0
    assert r0["ref_after"] == r1["ref_after"]  # the same reference on every rank
    assert r0["policy_after"] == r1["policy_after"]  # DDP kept the policies in step


def _hand_logp(model: torch.nn.Module, ids: list[int], start: int) -> tuple[float, int]:
    """log p(ids[start:] | ids[:t]) summed, from one unpadded sequence, in float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return sum(float(lp[t - 1, ids[t]]) for t in range(start, len(ids))), len(ids) - start


def _ls(x: float) -> float:  # log sigmoid
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize("loss_type", ["sigmoid", "conservative", "robust", "ipo"])
def test_loss_matches_hand_computation(lm: Path, tmp_path: Path, loss_type: str) -> None:
    from ddp import recipes

    data = write_pairs(tmp_path / "pairs.json", 3, seed=4)
    beta, eps = 0.5, 0.2
    recipe = recipes.get("dpo")
    cfg = recipes.resolve(
        recipe,
        None,
        [
            f"model.name_or_path={lm}",
            f"recipe.train_data={data}",
            "recipe.val_fraction=0",
            f"recipe.beta={beta}",
            f"recipe.loss_type={loss_type}",
            f"recipe.label_smoothing={eps}",
        ],
    )
    built = recipe.build(cfg)
    policy = built.model
    with torch.no_grad():  # policy != reference, so the log-ratios are not 0
        g = torch.Generator().manual_seed(1)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    items = [built.train_data[i] for i in range(3)]  # differing lengths: padding matters
    out = built.step_fn(policy, built.collate_fn(items))
    ref = built.reference.model
    per, rewards = [], []
    for it in items:
        (pc, nc), (pr, nr) = (
            _hand_logp(policy, it[s], it[f"{s}_start"]) for s in ("chosen", "rejected")
        )
        (rc, _), (rr, _) = (
            _hand_logp(ref, it[s], it[f"{s}_start"]) for s in ("chosen", "rejected")
        )
        d = (pc - rc) - (pr - rr)
        if loss_type == "sigmoid":
            per.append(-_ls(beta * d))
        elif loss_type == "conservative":
            per.append(-(1 - eps) * _ls(beta * d) - eps * _ls(-beta * d))
        elif loss_type == "robust":
            per.append((-(1 - eps) * _ls(beta * d) + eps * _ls(-beta * d)) / (1 - 2 * eps))
        else:
            per.append(((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2)
        rewards.append((beta * (pc - rc), beta * (pr - rr)))
    assert float(out["loss"].detach()) == pytest.approx(sum(per) / 3, rel=1e-4, abs=1e-6)
    assert float(out["reward_chosen"]) == pytest.approx(sum(c for c, _ in rewards) / 3, abs=1e-5)
    assert float(out["reward_margin"]) == pytest.approx(
        sum(c - r for c, r in rewards) / 3, abs=1e-5
    )
    assert float(out["reward_acc"]) == pytest.approx(sum(c > r for c, r in rewards) / 3)
    assert abs(sum(c - r for c, r in rewards)) > 1e-3  # the check is not vacuous


def test_pdb_record_trains_on_two_ranks_with_the_seeds_lines(lm: Path, tmp_path: Path) -> None:
    """The real CLI on 2 ranks: a record naming a PDB file (chain A -> its sequence) trains;
    the seed's progress lines print; final/hf loads with from_pretrained."""
    seq = write_pdb(tmp_path / "tiny.pdb")
    data = write_pairs(tmp_path / "train.json", 9, structure="tiny.pdb")
    val = write_pairs(tmp_path / "val.json", 4, seed=7, structure="tiny.pdb")
    out_dir = tmp_path / "run"
    results = _launch.run(
        [
            "-m",
            "ddp",
            "dpo",
            "--model_name_or_path",
            str(lm),
            "--train_data",
            str(data),
            "--val_data",
            str(val),
            "--output_dir",
            str(out_dir),
            "--num_epochs",
            "2",
            "--backend",
            "gloo",
            "--learning_rate",
            "1e-3",
            "--set",
            "logging.progress=off",
        ],
        world=2,
        timeout=240,
    )
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    stdout = results[0][1]
    assert "Loaded 10 training and 5 validation pairs" in stdout
    # said once, not clamped silently: the tiny model has 64 positions, max_len is 512
    assert "model.max_len 512: the model has 64 positions" in stdout + results[0][2]
    assert "Batch size per GPU: 1, Total batch size: 2" in stdout
    for k in (1, 2):
        assert f"Epoch {k} Summary:\n  Train Loss: " in stdout
    assert stdout.count("  Val Loss:   ") == 2
    assert "Loaded" not in results[1][1]  # rank 0 only
    from transformers import AutoModelForCausalLM

    from ddp.recipes.dpo import load_pairs

    assert load_pairs(data, "x")[-1]["prompt"] == seq
    trained = AutoModelForCausalLM.from_pretrained(out_dir / "final" / "hf")
    exported = torch.load(out_dir / "final" / "model.pt", weights_only=True)
    assert torch.equal(
        trained.state_dict()["transformer.wte.weight"], exported["transformer.wte.weight"]
    )


def test_structure_errors_and_mmcif(tmp_path: Path) -> None:
    from Bio.PDB import MMCIFIO, PDBParser

    from ddp.errors import ConfigError
    from ddp.recipes.dpo import load_pairs

    write_pdb(tmp_path / "tiny.pdb")
    io = MMCIFIO()
    io.set_structure(PDBParser(QUIET=True).get_structure("t", tmp_path / "tiny.pdb"))
    io.save(str(tmp_path / "tiny.cif"))
    rec = {"chosen": "A", "rejected": "C"}
    (tmp_path / "p.json").write_text(json.dumps([{**rec, "structure": "tiny.cif", "chain": "B"}]))
    assert load_pairs(tmp_path / "p.json", "k")[0]["prompt"] == "GS"
    for bad, msg in [
        ({"structure": "tiny.pdb", "chain": "Z"}, "has no chain 'Z'; allowed: A, B"),
        ({"structure": "nope.pdb"}, "does not exist"),
        ({"structure": "p.json"}, "holds no chain"),
        ({"chosen": "A"}, "has no string 'prompt'"),
    ]:
        (tmp_path / "b.json").write_text(json.dumps([{**rec, **bad}]))
        with pytest.raises(ConfigError, match=msg):
            load_pairs(tmp_path / "b.json", "k")


def test_cli_errors_are_one_line(lm: Path, tmp_path: Path) -> None:
    data = write_pairs(tmp_path / "pairs.json", 4)
    for args, msg in [
        (["--model_name_or_path", str(tmp_path / "none")], "model.name_or_path"),
        (["--loss_type", "hinge"], "recipe.loss_type: 'hinge'; allowed: sigmoid, conservative"),
        (["--label_smoothing", "0.5"], "recipe.label_smoothing"),
    ]:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddp",
                "dpo",
                "--train_data",
                str(data),
                *args,
                "--output_dir",
                str(tmp_path / "o"),
            ],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=120,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and msg in lines[0], proc.stderr


def test_missing_transformers_names_the_extra(tmp_path: Path) -> None:
    """Without transformers the run ends with one line naming `pip install hpc-ddp[dpo]`."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "transformers.py").write_text("raise ImportError('blocked for the test')\n")
    env = _env()
    env["PYTHONPATH"] = f"{block}{os.pathsep}{env['PYTHONPATH']}"
    proc = subprocess.run(
        [sys.executable, "-m", "ddp", "dpo", "--output_dir", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "ddp: error: the dpo recipe needs transformers: pip install 'hpc-ddp[dpo]'"
    )


def test_precomputed_reference_logps_match_the_live_reference(lm: Path, tmp_path: Path) -> None:
    """precompute_ref_logps: log-probs stored with the data, the reference freed, and the
    loss on a batch equal to the one with the live reference."""
    from ddp import recipes

    data = write_pairs(tmp_path / "pairs.json", 4, seed=2)
    recipe = recipes.get("dpo")
    sets = [f"model.name_or_path={lm}", f"recipe.train_data={data}", "recipe.val_fraction=0"]
    live = recipe.build(recipes.resolve(recipe, None, sets))
    pre = recipe.build(recipes.resolve(recipe, None, [*sets, "recipe.precompute_ref_logps=true"]))
    assert pre.reference.model is None and "ref" in pre.train_data[0]
    for b in (live, pre):
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for p in b.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    items = [live.train_data[i] for i in range(4)]
    a = live.step_fn(live.model, live.collate_fn(items))
    b = pre.step_fn(pre.model, pre.collate_fn([pre.train_data[i] for i in range(4)]))
    assert float(a["loss"].detach()) == pytest.approx(float(b["loss"].detach()), abs=1e-6)
    assert float(a["loss"].detach()) != pytest.approx(math.log(2), abs=1e-4)


def test_precomputed_logps_are_stored_and_reused_only_when_they_fit(
    lm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """<checkpoint.dir>/ref_logps.pt is written once, read by the next build with the same
    reference and data, and refused (computed afresh) for other data or a damaged file."""
    import logging

    from ddp import recipes
    from ddp.recipes import dpo

    recipe = recipes.get("dpo")

    def build(n: int) -> recipes.Built:
        data = write_pairs(tmp_path / f"p{n}.json", n, seed=3)
        return recipe.build(
            recipes.resolve(
                recipe,
                None,
                [
                    f"model.name_or_path={lm}",
                    f"recipe.train_data={data}",
                    "recipe.val_fraction=0.25",
                    "recipe.precompute_ref_logps=true",
                    f"checkpoint.dir={tmp_path / 'run'}",
                ],
            )
        )

    cache = tmp_path / "run" / dpo.REF_CACHE
    first = build(8)
    assert cache.is_file()
    with caplog.at_level(logging.INFO, logger="ddp"):
        again = build(8)
    assert f"reference log-probs read from {cache}" in caplog.text
    assert torch.equal(again.train_data.ref, first.train_data.ref)
    assert torch.equal(again.eval_data.ref, first.eval_data.ref)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddp"):
        other = build(12)
    assert "written for another reference or data; computing afresh" in caplog.text
    assert other.train_data.ref.shape == (9, 2)
    cache.write_bytes(b"damaged")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddp"):
        third = build(8)
    assert "computing afresh" in caplog.text
    assert torch.allclose(third.train_data.ref, first.train_data.ref)


def test_remote_code_never_runs_unless_asked(tmp_path: Path) -> None:
    """A model folder whose config names its own code (auto_map): refused in one line,
    and that code is never imported, unless --trust_remote_code is given."""
    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil",
                "architectures": ["EvilLM"],
                "auto_map": {
                    "AutoConfig": "modeling_evil.EvilConfig",
                    "AutoModelForCausalLM": "modeling_evil.EvilLM",
                },
            }
        )
    )
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    data = write_pairs(tmp_path / "pairs.json", 4)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp",
            "dpo",
            "--model_name_or_path",
            str(folder),
            "--train_data",
            str(data),
            "--output_dir",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "model.name_or_path" in lines[0] and "trust_remote_code" in lines[0]
    assert not marker.exists()


def test_bf16_checkpoint_trains_in_fp32_master_weights(lm: Path, tmp_path: Path) -> None:
    """A model folder saved in bf16 (as most hub models are) is loaded as float32: with
    bf16 weights, AdamW's lr 3e-7 updates would round to nothing."""
    from transformers import AutoModelForCausalLM

    from ddp import recipes

    folder = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(lm).to(torch.bfloat16).save_pretrained(folder)
    for f in lm.glob("tokenizer*"):
        (folder / f.name).write_bytes(f.read_bytes())
    recipe = recipes.get("dpo")
    cfg = recipes.resolve(
        recipe,
        None,
        [
            f"model.name_or_path={folder}",
            f"recipe.train_data={write_pairs(tmp_path / 'p.json', 3)}",
        ],
    )
    built = recipe.build(cfg)
    assert {p.dtype for p in built.model.parameters()} == {torch.float32}
    assert {p.dtype for p in built.reference.model.parameters()} == {torch.float32}
