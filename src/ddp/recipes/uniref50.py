"""UniRef50 protein LM by score entropy discrete diffusion, SEDD (seed 004).

The model is SEDD's: a DiT-style transformer conditioned on the noise level
(:mod:`ddp.sedd`), trained with the denoising score entropy over an absorbing (default)
or uniform transition graph with a log-linear or geometric noise schedule;
``model.loss: mdlm`` trains the same network with the MDLM loss instead. Diffusion
states are the 20 amino acids, ``X`` (any other residue) and the end-of-sequence filler
(the padding of a window of ``model.max_len``), so the model learns lengths too and a
sample's length is its residues before the first filler. Losses and the evaluation's
perplexity bound (``eval_ppl_bound = exp(eval_loss)``, nats per position) count every
position of the window. Every ``monitoring.sample_frequency`` optimizer steps rank 0
writes ``monitoring.num_samples`` sampled sequences to ``samples/step_N.fasta`` in the
run directory and logs their lengths and amino-acid composition.
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

import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

import ddp
from ddp import fsdp, parts, sedd
from ddp.checkpoint import atomic_write_text
from ddp.config import TrainConfig
from ddp.data import fasta
from ddp.data.dataset import TokenDataset
from ddp.data.store import TokenStore, read_regular
from ddp.errors import ConfigError
from ddp.recipes import DATA_DIR, Built, Flag, seeded_model
from ddp.recipes._common import AMINO_ACIDS, PAD, UNK

NAME = "uniref50"
DESCRIPTION = "protein score entropy discrete diffusion (SEDD; MDLM as a choice) on a FASTA file"

log = logging.getLogger("ddp")

# The seed's values, where the seed gives one; every other key says where it comes from.
# configs/uniref50-tiny.yaml is the few-seconds version for a laptop and the tests.
DEFAULTS: dict[str, Any] = {
    "training": {
        "batch_size": 16,
        "accum": 4,  # seed: 16 x 4 per GPU
        # The seed names no epoch count (its tables count 100k steps); one pass
        # over UniRef50 is already ~1M steps at 64 sequences a step.
        "epochs": 1,
        "seed": 0,
    },
    "optim": {
        "name": "adamw",
        "lr": 5e-5,
        "warmup_steps": 5000,  # seed: base lr, warmup
        # not in the seed: SEDD's own (no weight decay, constant after warmup, clip 1)
        "weight_decay": 0.0,
        "schedule": "constant",
        "grad_clip": 1.0,
    },
    "scaling": {"rule": "linear", "base_world_size": 1, "scale_warmup": True},  # seed: linear
    "precision": "bf16",  # seed: memory.mixed_precision: True (bf16 needs no GradScaler)
    "memory": {"gradient_checkpointing": False, "max_memory_fraction": 0.85},  # seed
    "data": {"num_workers": 4},  # seed: training.num_workers: 4
    "checkpoint": {"dir": "runs/uniref50"},
    "logging": {"every_n_steps": 50},
    "monitoring": {
        "sample_frequency": 5000,
        "log_gradients": False,  # seed
        "log_weights": False,
        "num_samples": 8,
        # not in the seed: SEDD samples in as many steps as positions; half
        # of that costs little every 5000 steps
        "sample_steps": 256,
        "predictor": "analytic",
    },
    # SEDD small: 768 wide (the seed's hidden_size), 12 blocks of 12 heads, a 128-wide
    # noise embedding, dropout 0.1. max_len 512 (not SEDD's 1024 text tokens): most
    # UniRef50 clusters' sequences fit whole, at half the attention memory.
    "model": {
        "loss": "sedd",
        "graph": "absorbing",
        "noise": "loglinear",
        "d_model": 768,
        "n_layers": 12,
        "n_heads": 12,
        "cond_dim": 128,
        "max_len": 512,
        "dropout": 0.1,
        "sigma_min": 1e-4,
        "sigma_max": 20.0,
        "noise_eps": 1e-3,
    },  # SEDD's schedules
    "recipe": {
        "data": "",
        "cache_dir": "",
        "eval_fraction": 0.1,
        "split_salt": 0,
        "t_min": 1e-3,  # SEDD's: t ~ U(t_min, 1), as its sampling_eps
        "eval_seed": 1234,
    },
}

FLAGS = [
    Flag(
        "--datafile",
        "recipe.data",
        str,
        "FASTA file (.gz too) or its prepared token store (default: the shipped tiny one)",
    ),
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
            raise ConfigError(
                f"{str(path)!r}: none of its {store.n_seqs:,} sequences falls in "
                f"the training split (recipe.eval_fraction={fraction}); allowed: "
                "a store with more sequences or a smaller eval_fraction"
            )
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


#: Diffusion states: 0 the end-of-sequence filler (the store's padding), 1 ``X`` (any
#: other residue), then the 20 amino acids; the absorbing graph adds its mask after them.
N_STATES = 2 + len(AMINO_ACIDS)
_STATE = torch.ones(UNK + 1 + len(AMINO_ACIDS), dtype=torch.long)  # store id -> state
_STATE[PAD] = 0
_STATE[UNK + 1 :] = torch.arange(2, N_STATES)
_LETTERS = "-X" + AMINO_ACIDS


def to_states(tokens: torch.Tensor) -> torch.Tensor:
    """Token-store ids (``ddp.data.fasta``'s vocabulary) as diffusion states."""
    return _STATE.to(tokens.device)[tokens.clamp(0, len(_STATE) - 1)]


def to_sequence(states: torch.Tensor) -> str:
    """A sampled row as residues: everything before its first end-of-sequence state."""
    text = "".join(_LETTERS[int(i)] if int(i) < len(_LETTERS) else "X" for i in states)
    return text.split("-", 1)[0]


def run_dir(config: TrainConfig) -> str:
    """Where samples/ goes: the run directory ``hpc submit`` made, else checkpoint.dir."""
    return os.environ.get("HPC_RUN_DIR") or config.checkpoint.dir or "."


def sample_stats(seqs: list[str]) -> dict[str, float]:
    """Mean, min and max length and each amino acid's share of all sampled residues."""
    lengths = [len(q) for q in seqs]
    total = max(1, sum(lengths))
    out: dict[str, float] = {
        "len_mean": sum(lengths) / max(1, len(seqs)),
        "len_min": min(lengths, default=0),
        "len_max": max(lengths, default=0),
    }
    for a in AMINO_ACIDS + "X":
        out[f"aa_{a}"] = sum(q.count(a) for q in seqs) / total
    return out


def write_samples(path: str, seqs: list[str], step: int) -> None:
    """``samples/step_N.fasta`` written atomically (a reader never sees half a file)."""
    text = "".join(f">sample_{i} step={step} length={len(q)}\n{q}\n" for i, q in enumerate(seqs))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(text, path)


def check_model(m: dict[str, Any]) -> None:
    for key, allowed in (("loss", sedd.LOSSES), ("graph", sedd.GRAPHS), ("noise", sedd.SCHEDULES)):
        if m[key] not in allowed:
            raise ConfigError(f"model.{key}: {m[key]!r}; allowed: {', '.join(allowed)}")
    if m["loss"] == "mdlm" and m["graph"] != "absorbing":
        raise ConfigError("model.loss: mdlm needs model.graph: absorbing (MDLM masks tokens)")
    if not 0 < m["sigma_min"] < m["sigma_max"] or not 0 < m["noise_eps"] < 1:
        raise ConfigError(
            f"model.sigma_min/sigma_max/noise_eps: {m['sigma_min']}, "
            f"{m['sigma_max']}, {m['noise_eps']}; allowed: 0 < sigma_min < "
            "sigma_max and noise_eps in (0, 1)"
        )
    if m["max_len"] < 1 or m["d_model"] < 1 or m["n_layers"] < 1 or m["cond_dim"] < 1:
        raise ConfigError("model.max_len, d_model, n_layers, cond_dim: allowed: integers >= 1")


def build(config: TrainConfig) -> Built:
    m, r = config.model, config.recipe
    check_model(m)
    t_min = float(r["t_min"])
    if not 0 <= t_min < 1:
        raise ConfigError(f"recipe.t_min: {t_min}; allowed: a number in [0, 1)")
    train, evals = open_data(config)
    graph = sedd.make_graph(m["graph"], N_STATES)
    noise = sedd.make_noise(m["noise"], m["sigma_min"], m["sigma_max"], m["noise_eps"])
    model = seeded_model(
        config.training.seed,
        lambda: sedd.DiT(
            graph.n,
            m["d_model"],
            m["n_layers"],
            m["n_heads"],
            m["cond_dim"],
            m["max_len"],
            m["dropout"],
        ),
    )
    loss = m["loss"]
    step, evaluate = _losses(graph, noise, t_min, loss, int(r["eval_seed"]))
    after_step = _sampling(config, graph, noise, loss)
    return Built(
        model, train, evals, step, evaluate, after_step=after_step, finish_eval=_finish_eval
    )


def _losses(graph: Any, noise: Any, t_min: float, loss: str, eval_seed: int) -> tuple[Any, Any]:
    """(training step, evaluation step): the diffusion loss over t in [t_min, 1]; the
    evaluation's noise is seeded per sequence."""

    def step(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x0 = to_states(tokens)
        t = torch.rand(x0.shape[0], device=x0.device) * (1 - t_min) + t_min
        # (1 - t_min): the integral over [t_min, 1] of which the mean is an estimate
        return {"loss": sedd.diffusion_loss(model, x0, graph, noise, t, loss).mean() * (1 - t_min)}

    def evaluate(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
        # Noise drawn per sequence from a generator seeded by its content, so the eval
        # loss does not depend on batch composition or world size.
        x0 = to_states(tokens).cpu()
        ts, xs = [], []
        for row in x0:
            g = torch.Generator().manual_seed(eval_seed + int((row * torch.arange(len(row))).sum()))
            t = torch.rand(1, generator=g) * (1 - t_min) + t_min
            ts.append(t)
            xs.append(graph.perturb(row[None], noise.total(t), g))
        t, x_t = torch.cat(ts).to(tokens.device), torch.cat(xs).to(tokens.device)
        nelbo = sedd.diffusion_loss(model, x0.to(tokens.device), graph, noise, t, loss, x_t=x_t) * (
            1 - t_min
        )
        return {"loss": nelbo.mean(), "n": tokens.shape[0]}

    return step, evaluate


def _finish_eval(metrics: dict[str, float]) -> dict[str, float]:
    """The perplexity bound exp(eval_loss) beside the evaluation's loss."""
    if "eval_loss" in metrics:  # the ELBO per position bounds -log p: its exp, perplexity
        metrics["eval_ppl_bound"] = math.exp(min(metrics["eval_loss"], 700.0))
    return metrics


def _sampling(config: TrainConfig, graph: Any, noise: Any, loss: str) -> Any:
    """The hook after each optimizer step: at ``monitoring.sample_frequency``, sequences
    sampled from the model, written as FASTA and summarised in the logs."""
    m, mon = config.model, config.monitoring

    def after_step(trainer: Any, step: int) -> None:
        freq = mon.sample_frequency
        if not freq or step % freq:
            return
        net = ddp.unwrap(trainer.wrapped)
        sharded = fsdp.is_sharded(net)  # FSDP: every rank runs the forwards, rank 0 writes
        if not (sharded or trainer.ctx.is_main):
            return
        dev = trainer.ctx.device
        g = torch.Generator(dev).manual_seed(config.training.seed * 1_000_003 + step)
        was = net.training
        net.eval()
        try:
            with parts.autocast(config.precision, dev):
                states = sedd.sample(
                    net,
                    graph,
                    noise,
                    (mon.num_samples, m["max_len"]),
                    mon.sample_steps,
                    mon.predictor,
                    loss,
                    device=dev,
                    generator=g,
                )
        finally:
            net.train(was)
        if not trainer.ctx.is_main:
            return
        seqs = [to_sequence(row) for row in states.cpu()]
        path = os.path.join(run_dir(config), "samples", f"step_{step}.fasta")
        write_samples(path, seqs, step)
        stats = sample_stats(seqs)
        top = sorted(AMINO_ACIDS, key=lambda a: -stats[f"aa_{a}"])[:5]
        log.info(
            "samples step %d: %s; length mean %.1f (min %d, max %d); most frequent %s",
            step,
            path,
            stats["len_mean"],
            stats["len_min"],
            stats["len_max"],
            " ".join(f"{a}={stats[f'aa_{a}']:.3f}" for a in top),
        )
        trainer.loggers.samples(stats, step)

    return after_step
