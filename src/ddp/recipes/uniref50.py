"""UniRef50-style protein LM by absorbing-state (masked) discrete diffusion (seed 004).

Forward process: each residue is replaced by ``<mask>`` with probability t,
t ~ U(t_min, 1). The model sees the partly masked sequence and t and predicts
the masked residues; the loss is the MDLM ELBO, sum over masked positions of
CE / t, divided by the number of real residues (so it is per residue).
Trained from a FASTA file through a memory-mapped token store (``ddp.data``):
``--datafile`` takes the FASTA (prepared once into a store beside it, or in
``recipe.cache_dir``) or a store made by ``python -m ddp.data prepare-fasta``, so
memory per rank stays flat at UniRef50's real size. Sequences are cropped to
``model.max_len`` (their first residues) and padded per sample. A sequence is held
out for evaluation by a hash of its id (``recipe.eval_fraction``, ``split_salt``).
The shipped ``data/uniref50_tiny.fasta`` (made by ``scripts/make_fasta.py``) has
Markov + motif structure, so the loss falls within seconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ddp
from ddp.config import TrainConfig
from ddp.data import fasta
from ddp.data.dataset import TokenDataset
from ddp.data.store import TokenStore, read_regular
from ddp.errors import ConfigError
from ddp.recipes import DATA_DIR, Built, Flag, seeded_model
from ddp.recipes._common import MASK, PAD, TinyTransformer

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
    "recipe": {"data": "", "cache_dir": "", "eval_fraction": 0.1, "split_salt": 0,
               "t_min": 0.05, "eval_seed": 1234},  # fmt: skip
}

FLAGS = [
    Flag("--datafile", "recipe.data", str,
         "FASTA file (.gz too) or its prepared token store (default: the shipped tiny one)"),
    Flag("--work_dir", "checkpoint.dir", str, "the seed's name for --output_dir"),
    Flag("--batch_size", "training.batch_size", int, "batch size per rank"),
    Flag("--epochs", "training.epochs", int, "epochs"),
    Flag("--lr", "optim.lr", float, "base learning rate (scaled by scaling.rule)"),
]


def read_fasta(path: str | Path) -> list[str]:
    """Sequences of a small FASTA file (headers dropped, wrapped lines joined).

    For tests and small scripts only: training reads a token store
    (:func:`ddp.data.fasta.resolve_store`), whose memory does not grow with the file.
    """
    try:
        text = read_regular(path, "a FASTA file", 1 << 30).decode()
    except ConfigError as exc:
        raise ConfigError(f"recipe.data: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe.data: cannot read FASTA {str(path)!r}: {exc}") from None
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


def _split_settings(r: dict[str, Any]) -> tuple[float, int]:
    """(eval_fraction, split_salt), checked: the split hashes with uint64 arithmetic."""
    frac, salt = r["eval_fraction"], r["split_salt"]
    if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 <= frac < 1:
        raise ConfigError(f"recipe.eval_fraction: {frac!r}; allowed: a number in [0, 1)")
    if isinstance(salt, bool) or not isinstance(salt, int) or not 0 <= salt < 2**64:
        raise ConfigError(f"recipe.split_salt: {salt!r}; allowed: an integer in [0, 2**64)")
    return float(frac), salt


def open_data(config: TrainConfig) -> tuple[TokenDataset, TokenDataset | None]:
    """Collective: (train, eval) datasets over the token store of ``recipe.data``.

    A FASTA file is prepared into a store once (rank 0; see ``resolve_store``); the
    evaluation split is a rule over sequence ids (``TokenStore.split``), so nothing
    reads the whole file first. Rank 0 writes the split's index files before the
    others open them (in the store, or in the cache when the store is read-only).
    The store is checked on open (header, sizes, its vocabulary against the
    tokenizer's); one with no tokens or no training sequence stops in one line.
    """
    m, r = config.model, config.recipe
    fraction, salt = _split_settings(r)
    data = r["data"] or DATA_DIR / "uniref50_tiny.fasta"
    shipped = not r["data"]
    cache = r["cache_dir"] or (fasta.cache_dir() if shipped else None)

    def open_split() -> tuple[TokenStore, Any, Any]:
        store = TokenStore(path, fasta.TOKENIZER, fasta.VOCAB_SIZE)
        train_idx, eval_idx = store.split(fraction, salt, cache=r["cache_dir"] or None)
        if not len(train_idx):
            raise ConfigError(f"{str(path)!r}: none of its {store.n_seqs:,} sequences falls in "
                              f"the training split (recipe.eval_fraction={fraction}); allowed: "
                              "a store with more sequences or a smaller eval_fraction")  # fmt: skip
        return store, train_idx, eval_idx

    try:
        path = fasta.resolve_store(data, cache)
        error = None
        if ddp.is_main_process():
            try:
                open_split()
            except ConfigError as exc:
                error = str(exc)
        error = ddp.broadcast_object(error)
        if error:
            raise ConfigError(error)
        store, train_idx, eval_idx = open_split()
    except ConfigError as exc:
        raise ConfigError(f"recipe.data: {exc}") from None
    train = TokenDataset(store, m["max_len"], PAD, train_idx)
    evals = TokenDataset(store, m["max_len"], PAD, eval_idx) if len(eval_idx) else None
    return train, evals


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
    train, evals = open_data(config)
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
