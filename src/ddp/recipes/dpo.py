"""Direct Preference Optimization on prompt/chosen/rejected sequence pairs (seed 001).

A small causal LM policy and a frozen copy of it as the reference live in one
module (:class:`DPOModel`), so DDP syncs only the policy's gradients (the
reference has ``requires_grad=False``) and the step is one forward. Loss:
``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` over response-token
log-probabilities; reward accuracy is the share of pairs whose chosen reward is
higher. Data: a JSON list of ``{"prompt", "chosen", "rejected"}`` strings; the
shipped ``data/dpo_pairs.json`` comes from ``scripts/make_fasta.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp.config import TrainConfig
from ddp.errors import ConfigError
from ddp.recipes import DATA_DIR, Built, Flag, seeded_model
from ddp.recipes._common import BOS, EOS, PAD, TinyTransformer, encode

NAME = "dpo"
DESCRIPTION = "DPO: small policy LM vs frozen reference on preference pairs (JSON)"

DEFAULTS: dict[str, Any] = {
    "training": {"batch_size": 16, "epochs": 3, "seed": 0},
    "optim": {"name": "adamw", "lr": 1e-3, "warmup_steps": 5, "schedule": "constant",
              "grad_clip": 1.0},  # fmt: skip
    "checkpoint": {"dir": "outputs/dpo_ddp"},
    "logging": {"every_n_steps": 10},
    "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_len": 32, "dropout": 0.0},
    "recipe": {"train_data": "", "val_data": "", "val_fraction": 0.1, "beta": 0.1},
}

FLAGS = [
    Flag("--train_data", "recipe.train_data", str, "JSON pairs (default: the shipped ones)"),
    Flag("--val_data", "recipe.val_data", str, "JSON validation pairs (default: split off)"),
    Flag("--batch_size", "training.batch_size", int, "batch size per rank"),
    Flag("--num_epochs", "training.epochs", int, "epochs"),
    Flag("--learning_rate", "optim.lr", float, "learning rate"),
    Flag("--beta", "recipe.beta", float, "DPO temperature"),
]


def load_pairs(path: str | Path, key: str) -> list[dict[str, str]]:
    try:
        pairs = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{key}: {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(pairs, list) or not all(
        isinstance(p, dict) and {"prompt", "chosen", "rejected"} <= p.keys() for p in pairs
    ):
        raise ConfigError(f"{key}: {str(path)!r} must be a list of prompt/chosen/rejected objects")
    return pairs


class PairDataset(Dataset):
    """Each pair as two token rows ``<bos> prompt <eos> response <eos>`` + response masks."""

    def __init__(self, pairs: list[dict[str, str]], max_len: int) -> None:
        n = len(pairs)
        self.tokens = torch.full((n, 2, max_len), PAD, dtype=torch.long)
        self.resp = torch.zeros((n, 2, max_len), dtype=torch.bool)
        for i, p in enumerate(pairs):
            prompt = [BOS, *encode(p["prompt"]), EOS]
            for j, key in enumerate(("chosen", "rejected")):
                ids = (prompt + encode(p[key]) + [EOS])[:max_len]
                self.tokens[i, j, : len(ids)] = torch.tensor(ids)
                self.resp[i, j, len(prompt) : len(ids)] = True

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[i], "resp": self.resp[i]}


def _logp(lm: nn.Module, tokens: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
    """Sum of log p(response tokens) per row (next-token prediction)."""
    logits = lm(tokens[:, :-1]).float()
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return (lp * resp[:, 1:]).sum(-1)


class DPOModel(nn.Module):
    """Policy + frozen reference; ``forward(batch)`` returns the DPO loss and metrics."""

    def __init__(self, policy: nn.Module, beta: float) -> None:
        super().__init__()
        self.policy = policy
        self.reference = copy.deepcopy(policy).requires_grad_(False).eval()
        self.beta = beta

    def train(self, mode: bool = True) -> DPOModel:
        super().train(mode)
        self.reference.eval()  # the reference never uses dropout
        return self

    @property
    def gradient_checkpointing(self) -> bool:
        return self.policy.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        self.policy.gradient_checkpointing = value

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        b = batch["tokens"].shape[0]
        tokens = batch["tokens"].flatten(0, 1)  # (2B, L): chosen, rejected interleaved
        resp = batch["resp"].flatten(0, 1)
        pi = _logp(self.policy, tokens, resp).view(b, 2)
        with torch.no_grad():
            ref = _logp(self.reference, tokens, resp).view(b, 2)
        reward = self.beta * (pi - ref)
        margin = reward[:, 0] - reward[:, 1]
        return {
            "loss": -nn.functional.logsigmoid(margin).mean(),
            "reward_acc": (margin > 0).float().mean(),
            "margin": margin.mean().detach(),
        }


def build(config: TrainConfig) -> Built:
    m, r = config.model, config.recipe
    pairs = load_pairs(r["train_data"] or DATA_DIR / "dpo_pairs.json", "recipe.train_data")
    if r["val_data"]:
        val = load_pairs(r["val_data"], "recipe.val_data")
    else:
        n_val = int(len(pairs) * r["val_fraction"])
        val, pairs = pairs[:n_val], pairs[n_val:]

    def make() -> DPOModel:
        policy = TinyTransformer(
            m["d_model"], m["n_layers"], m["n_heads"], m["max_len"], m["dropout"], causal=True
        )
        return DPOModel(policy, float(r["beta"]))  # the reference: a copy, so equal too

    model = seeded_model(config.training.seed, make)
    val_ds = PairDataset(val, m["max_len"]) if val else None
    return Built(model, PairDataset(pairs, m["max_len"]), val_ds, None, None)
