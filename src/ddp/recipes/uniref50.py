"""UniRef50-style protein LM by absorbing-state (masked) discrete diffusion (seed 004).

Forward process: each residue is replaced by ``<mask>`` with probability t,
t ~ U(t_min, 1). The model sees the partly masked sequence and t and predicts
the masked residues; the loss is the MDLM ELBO, sum over masked positions of
CE / t, divided by the number of real residues (so it is per residue).
Trained from a FASTA file; the shipped ``data/uniref50_tiny.fasta`` (made by
``scripts/make_fasta.py``) has Markov + motif structure, so the loss falls
within seconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ddp.config import TrainConfig
from ddp.errors import ConfigError
from ddp.recipes import DATA_DIR, Built, Flag, seeded_model
from ddp.recipes._common import MASK, PAD, TinyTransformer, encode

NAME = "uniref50"
DESCRIPTION = "protein masked-diffusion LM (absorbing state) on a FASTA file"

DEFAULTS: dict[str, Any] = {
    "training": {"batch_size": 16, "accum": 1, "epochs": 4, "seed": 0},
    "optim": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01, "warmup_steps": 10,
              "schedule": "cosine", "grad_clip": 1.0},  # fmt: skip
    "scaling": {"rule": "linear", "base_world_size": 1, "scale_warmup": True},
    "checkpoint": {"dir": "runs/uniref50"},
    "logging": {"every_n_steps": 10},
    "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_len": 64, "dropout": 0.0},
    "recipe": {"data": "", "eval_fraction": 0.1, "t_min": 0.05, "eval_seed": 1234},
}

FLAGS = [
    Flag("--datafile", "recipe.data", str, "FASTA file (default: the shipped tiny one)"),
    Flag("--work_dir", "checkpoint.dir", str, "the seed's name for --output_dir"),
    Flag("--batch_size", "training.batch_size", int, "batch size per rank"),
    Flag("--epochs", "training.epochs", int, "epochs"),
    Flag("--lr", "optim.lr", float, "base learning rate (scaled by scaling.rule)"),
]


def read_fasta(path: str | Path) -> list[str]:
    """Sequences of a FASTA file (headers dropped, wrapped lines joined)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"recipe.data: cannot read FASTA {str(path)!r}: {exc.strerror}") from None
    seqs: list[str] = []
    cur: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(">"):
            if cur:
                seqs.append("".join(cur))
            cur = []
        elif line:
            cur.append(line)
    if cur:
        seqs.append("".join(cur))
    if not seqs:
        raise ConfigError(f"recipe.data: {str(path)!r} holds no FASTA sequences")
    return seqs


class ProteinDataset(Dataset):
    """Sequences cropped to ``max_len`` and right-padded with ``<pad>`` (one tensor)."""

    def __init__(self, seqs: list[str], max_len: int) -> None:
        self.tokens = torch.full((len(seqs), max_len), PAD, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids = encode(s)[:max_len]
            self.tokens[i, : len(ids)] = torch.tensor(ids)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def diffusion_loss(
    model: torch.nn.Module, tokens: torch.Tensor, t: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence ELBO per residue, masked CE sum and masked count, given t and uniforms u."""
    real = tokens != PAD
    masked = (u < t[:, None]) & real
    noisy = torch.where(masked, torch.full_like(tokens, MASK), tokens)
    logits = model(noisy, t)
    ce = torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), tokens, reduction="none"
    ) * masked
    n_real = real.sum(1).clamp(min=1)
    elbo = (ce / t[:, None]).sum(1) / n_real
    return elbo, ce.sum(1), masked.sum(1)


def build(config: TrainConfig) -> Built:
    m, r = config.model, config.recipe
    path = r["data"] or DATA_DIR / "uniref50_tiny.fasta"
    seqs = read_fasta(path)
    if not 0 <= r["eval_fraction"] < 1:
        raise ConfigError(f"recipe.eval_fraction: {r['eval_fraction']!r}; expected [0, 1)")
    n_eval = int(len(seqs) * r["eval_fraction"])
    train = ProteinDataset(seqs[n_eval:], m["max_len"])
    evals = ProteinDataset(seqs[:n_eval], m["max_len"]) if n_eval else None
    model = seeded_model(config.training.seed, lambda: TinyTransformer(
        m["d_model"], m["n_layers"], m["n_heads"], m["max_len"], m["dropout"],
        time_conditioned=True,
    ))  # fmt: skip
    t_min = float(r["t_min"])
    eval_seed = int(r["eval_seed"])

    def step(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        t = torch.rand(tokens.shape[0], device=tokens.device) * (1 - t_min) + t_min
        u = torch.rand(tokens.shape, device=tokens.device)
        elbo, ce, n = diffusion_loss(model, tokens, t, u)
        return {"loss": elbo.mean(), "masked_ce": ce.sum() / n.sum().clamp(min=1)}

    def evaluate(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
        # Noise drawn per sequence from a generator seeded by its content, so the eval
        # loss does not depend on batch composition or world size.
        ts, us = [], []
        for row in tokens.cpu():
            g = torch.Generator().manual_seed(eval_seed + int((row * torch.arange(len(row))).sum()))
            ts.append(torch.rand(1, generator=g) * (1 - t_min) + t_min)
            us.append(torch.rand(row.shape, generator=g))
        t = torch.cat(ts).to(tokens.device)
        u = torch.stack(us).to(tokens.device)
        elbo, _, _ = diffusion_loss(model, tokens, t, u)
        return {"loss": elbo.mean(), "n": tokens.shape[0]}

    return Built(model, train, evals, step, evaluate)
