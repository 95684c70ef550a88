"""Tokens/s of ``python -m ddp dpo``'s training loop vs TRL's ``DPOTrainer``, one process.

Same run, same tiny GPT-2 (built locally with ``GPT2Config`` and ``save_pretrained``, a
tokenizer trained on a few lines), same pairs, same batch, beta, lr, sigmoid loss, a
live reference model in both (no precomputed log-probs), dropout off in both. Timed:
training only (``Trainer.fit()`` vs ``DPOTrainer.train()``), after a warm-up run of
each, so model loading, tokenization and first-call costs are left out of both.
Tokens: the non-padding prompt+response tokens of both sides of every pair; the
recipe's count from its dataset, TRL's from its own ``num_tokens`` metric.

    PYTHONPATH=src:. python bench/dpo_vs_trl.py [--pairs 512] [--batch 8] [--n_embd 128]

Prints one line per contender and the ratio (recipe / TRL); >= 1.0x means the recipe is
at least as fast. On a GPU both run on ``cuda:0``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path[:0] = [
    str(Path(__file__).resolve().parents[1] / "src"),
    str(Path(__file__).resolve().parents[1]),
]

AA = "ACDEFGHIKLMNPQRSTVWY"


def build_model(folder: Path, n_embd: int, n_layer: int, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    rng = random.Random(seed)
    lines = [" ".join(rng.choice(AA) for _ in range(rng.randint(5, 40))) for _ in range(200)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        lines, trainers.BpeTrainer(vocab_size=256, special_tokens=["<pad>", "<eos>", "<unk>"])
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<eos>",
        unk_token="<unk>",
    )
    cfg = GPT2Config(
        vocab_size=len(fast),
        n_positions=256,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=4,
        bos_token_id=fast.eos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def write_pairs(path: Path, n: int, seed: int = 0) -> list[dict[str, str]]:
    """Space-separated residues (one token each): prompt, chosen = reversed, rejected random."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        p = [rng.choice(AA) for _ in range(rng.randint(20, 60))]
        pairs.append(
            {
                "prompt": " ".join(p),
                "chosen": " " + " ".join(p[::-1]),
                "rejected": " " + " ".join(rng.choice(AA) for _ in p),
            }
        )
    path.write_text(json.dumps(pairs))
    return pairs


def run_recipe(
    model: Path, data: Path, out: Path, batch: int, lr: float, beta: float, epochs: int
) -> tuple[float, int]:
    """(seconds in Trainer.fit, tokens) for the dpo recipe."""
    import ddp
    from ddp import recipes
    from ddp.trainer import Trainer

    recipe = recipes.get("dpo")
    cfg = recipes.resolve(
        recipe,
        None,
        [
            f"model.name_or_path={model}",
            f"recipe.train_data={data}",
            "recipe.val_fraction=0",
            f"training.batch_size={batch}",
            f"training.epochs={epochs}",
            f"optim.lr={lr}",
            f"recipe.beta={beta}",
            "checkpoint.dir=null",  # TRL side: save_strategy="no"
            "logging.progress=off",
            "logging.every_n_steps=1000000",
        ],
    )
    ddp.init(backend="auto")
    built = recipe.build(cfg)
    trainer = Trainer(
        built.model, built.train_data, cfg, built.step_fn, None, None, built.collate_fn
    )
    sync()
    t0 = time.perf_counter()
    trainer.fit()
    sync()
    dt = time.perf_counter() - t0
    ddp.shutdown()
    return dt, built.train_data.tokens() * epochs


def run_trl(
    model: Path,
    pairs: list[dict[str, str]],
    out: Path,
    batch: int,
    lr: float,
    beta: float,
    epochs: int,
) -> tuple[float, int]:
    """(seconds in DPOTrainer.train, tokens) for TRL with the same settings."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        num_train_epochs=epochs,
        learning_rate=lr,
        beta=beta,
        loss_type=["sigmoid"],
        max_length=512,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        report_to=[],
        logging_steps=1000000,
        save_strategy="no",
        disable_dropout=True,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        disable_tqdm=True,
        bf16=False,
        fp16=False,
    )
    policy = AutoModelForCausalLM.from_pretrained(model)
    tok = AutoTokenizer.from_pretrained(model)
    trainer = DPOTrainer(
        model=policy, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok
    )
    sync()
    t0 = time.perf_counter()
    trainer.train()
    sync()
    dt = time.perf_counter() - t0
    return dt, int(trainer._total_train_tokens)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n_embd", type=int, default=128)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each (best kept)")
    ap.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: steady figures on a shared machine)"
    )
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(a.threads)

    print(
        f"torch {torch.__version__}, device "
        f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}, "
        f"threads {torch.get_num_threads()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root / "lm", a.n_embd, a.n_layer)
        pairs = write_pairs(root / "pairs.json", a.pairs)
        lr, beta = 3e-7, 0.1
        # warm-up: a few pairs each, so first-call costs (kernels, imports) are paid
        warm = root / "warm.json"
        warm.write_text(json.dumps(pairs[: 2 * a.batch]))
        run_recipe(model, warm, root / "rw", a.batch, lr, beta, 1)
        run_trl(model, pairs[: 2 * a.batch], root / "tw", a.batch, lr, beta, 1)
        best: dict[str, tuple[float, int]] = {}
        for i in range(a.repeats):
            for name in ("recipe", "trl"):
                if name == "recipe":
                    res = run_recipe(
                        model, root / "pairs.json", root / f"r{i}", a.batch, lr, beta, a.epochs
                    )
                else:
                    res = run_trl(model, pairs, root / f"t{i}", a.batch, lr, beta, a.epochs)
                if name not in best or res[1] / res[0] > best[name][1] / best[name][0]:
                    best[name] = res
    for name, (dt, tokens) in best.items():
        print(f"{name:7s} {tokens:9d} tokens in {dt:7.2f} s: {tokens / dt:10.0f} tokens/s")
    ratio = (best["recipe"][1] / best["recipe"][0]) / (best["trl"][1] / best["trl"][0])
    print(
        f"recipe / TRL: {ratio:.2f}x  ({a.pairs} pairs, batch {a.batch}, GPT-2 n_embd "
        f"{a.n_embd} x {a.n_layer} layers, {a.epochs} epoch(s), best of {a.repeats})"
    )


if __name__ == "__main__":
    main()
