"""Direct Preference Optimization from a pretrained causal LM (seed 001, inverse folding).

The policy is any ``AutoModelForCausalLM`` named by ``--model_name_or_path`` (a hub id
or a local folder, the same ``from_pretrained`` call either way) or by
``--init_from`` (:mod:`ddp.init_from`: a model folder, hub id, ``final/model.pt`` or
step checkpoint). The reference is a frozen copy of the starting policy: kept *outside*
the module the Trainer wraps in DDP (so DDP never broadcasts, hooks or syncs it), no
gradients, always in eval mode, moved to the device on first use. Every rank loads the
same weights, so the references are bit-identical across ranks without a broadcast.
With ``recipe.precompute_ref_logps`` the reference's log-probabilities are computed
once per pair before training, stored with the data, and the reference is freed.

Loss (as TRL's ``DPOTrainer`` defines it, on token-summed completion log-probs):

* ``sigmoid``: ``-log σ(β Δ)``, Δ = (π_c − ref_c) − (π_r − ref_r);
* ``conservative`` (cDPO): ``-(1−ε) log σ(β Δ) − ε log σ(−β Δ)``, ε = label_smoothing;
* ``robust``: ``((1−ε)(−log σ(β Δ)) − ε(−log σ(−β Δ))) / (1 − 2ε)``;
* ``ipo``: ``(Δ̄ − 1/(2β))²`` with Δ̄ on length-normalised log-probs, as TRL does.

Logged: loss, reward_chosen / reward_rejected (β × log-ratio), reward_margin and
reward_acc (share of pairs whose chosen reward is higher).

Data: the seed's JSON list of ``{"prompt", "chosen", "rejected"}``. For inverse folding
a record may give ``"structure": "file.pdb"`` (PDB or mmCIF, relative to the JSON file)
and optionally ``"chain"`` instead of a prompt: Biopython's ``Bio.PDB`` parses it into
that chain's one-letter sequence (the first chain by default), which becomes the
prompt. Parsing happens once, in ``build``, so ``data.num_workers`` stays 0 as the seed
advises. Each side is tokenized with the model's tokenizer as ``prompt`` + ``response``
+ EOS; prompt and padding positions are masked out of the log-probs.

Without a model name or ``init_from`` the recipe builds a tiny GPT-2 from its config
with a character tokenizer over the amino acids: the quick start, which never downloads.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import ddp
from ddp.config import TrainConfig
from ddp.errors import ConfigError
from ddp.recipes import DATA_DIR, Built, Flag, seeded_model
from ddp.recipes._common import AMINO_ACIDS

# Re-exported: tests and callers name them ``ddp.recipes.dpo.X``.
from ddp.recipes._dpo_data import (  # noqa: F401
    MAX_JSON,
    MAX_STRUCTURE,
    PairDataset,
    load_pairs,
    make_collate,
    structure_sequence,
)
from ddp.recipes._dpo_loss import (  # noqa: F401
    LOSS_TYPES,
    _train_step,
    dpo_loss,
    make_step,
    sequence_logps,
)
from ddp.recipes._dpo_reference import (  # noqa: F401
    REF_CACHE,
    Reference,
    _main,
    precompute,
    stored_ref_logps,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("ddp")

NAME = "dpo"
DESCRIPTION = "DPO: pretrained causal LM policy vs frozen reference on preference pairs (JSON/PDB)"
EXTRA = "pip install 'hpc-ddp[dpo]'"

DEFAULTS: dict[str, Any] = {
    # Seed 001: batch 1 per device, lr 3e-7 (its run_dpo.py defaults and the guide's
    # scaling example). Epochs: 3, not the guide's quick-start 10, which it passes
    # explicitly (--num_epochs 10 works the same here).
    "training": {"batch_size": 1, "epochs": 3, "seed": 0},
    "optim": {
        "name": "adamw",
        "lr": 3e-7,
        "warmup_steps": 0,
        "schedule": "constant",
        "grad_clip": 1.0,
    },
    "checkpoint": {"dir": "outputs/dpo_ddp"},
    "logging": {"every_n_steps": 10},
    "model": {
        "name_or_path": "",  # hub id or folder of any AutoModelForCausalLM; "" = tiny demo
        "trust_remote_code": False,  # never run a model repository's code unless asked
        "max_len": 512,  # prompt + response tokens per sequence (longer: the end is cut)
        # The tiny demo GPT-2 (only when neither name_or_path nor init_from is given):
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
    },
    "recipe": {
        "train_data": "",
        "val_data": "",
        "val_fraction": 0.1,
        "beta": 0.1,
        "loss_type": "sigmoid",  # sigmoid | conservative | robust | ipo (TRL's definitions)
        "label_smoothing": 0.0,  # epsilon of conservative / robust
        "disable_dropout": True,  # as TRL: policy and reference agree at step 0
        "precompute_ref_logps": False,
    },
}

FLAGS = [
    Flag(
        "--model_name_or_path",
        "model.name_or_path",
        str,
        "policy and reference: a hub id or folder of any AutoModelForCausalLM",
    ),
    Flag("--train_data", "recipe.train_data", str, "JSON pairs (default: the shipped ones)"),
    Flag("--val_data", "recipe.val_data", str, "JSON validation pairs (default: split off)"),
    Flag("--batch_size", "training.batch_size", int, "pairs per rank per step"),
    Flag("--num_epochs", "training.epochs", int, "epochs"),
    Flag("--learning_rate", "optim.lr", float, "learning rate"),
    Flag("--beta", "recipe.beta", float, "DPO temperature"),
    Flag("--loss_type", "recipe.loss_type", str, "sigmoid, conservative, robust or ipo"),
    Flag(
        "--label_smoothing",
        "recipe.label_smoothing",
        float,
        "label-flip probability for the conservative and robust losses",
    ),
    Flag("--max_length", "model.max_len", int, "max prompt + response tokens"),
    Flag(
        "--trust_remote_code",
        "model.trust_remote_code",
        bool,
        "allow a model repository's own code to run (off by default)",
    ),
]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"the dpo recipe needs transformers: {EXTRA}") from None
    return transformers


# ---- model ----------------------------------------------------------------------------------
def demo_tokenizer() -> PreTrainedTokenizerBase:
    """A character tokenizer over the 20 amino acids (the quick start's sequences)."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    tf = _transformers()
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate([*specials, *AMINO_ACIDS])}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def load_policy(config: TrainConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, bool]:
    """(policy, tokenizer, whether model.init_from was loaded here)."""
    from ddp import init_from as weights

    tf = _transformers()
    m = config.model
    source, init = m["name_or_path"], m.get("init_from", "")
    trust = bool(m["trust_remote_code"])
    if init and weights.is_hf_source(init):
        source = init  # the policy's starting weights and architecture: that model
    if source:
        key = "model.init_from" if source == init else "model.name_or_path"
        try:
            # float32 master weights whatever the folder stores (transformers 5 keeps a
            # bf16 checkpoint in bf16, where AdamW's 3e-7 steps would round away);
            # `precision: bf16` autocasts the compute instead.
            policy = tf.AutoModelForCausalLM.from_pretrained(
                source, trust_remote_code=trust, dtype=torch.float32
            )
            tok = tf.AutoTokenizer.from_pretrained(
                source if _has_tokenizer(source) else m["name_or_path"] or source,
                trust_remote_code=trust,
            )
        except (OSError, ValueError, KeyError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ConfigError(
                f"{key}: {source!r} gives no causal LM and tokenizer ({first}); "
                "allowed: a hub id or folder of an AutoModelForCausalLM "
                "(trust_remote_code: off unless model.trust_remote_code)"
            ) from None
    else:
        tok = demo_tokenizer()
        cfg = tf.GPT2Config(
            vocab_size=len(tok),
            n_positions=m["max_len"],
            n_embd=m["d_model"],
            n_layer=m["n_layers"],
            n_head=m["n_heads"],
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        policy = seeded_model(config.training.seed, lambda: tf.GPT2LMHeadModel(cfg))
    loaded_here = bool(init) and source == init
    if init and not loaded_here:  # a .pt export or step checkpoint onto this architecture
        weights.apply(policy, init)
        loaded_here = True
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ConfigError(
                f"model.name_or_path: {source!r}'s tokenizer has neither a pad "
                "nor an EOS token; allowed: a tokenizer with either"
            )
        tok.pad_token = tok.eos_token
    return policy, tok, loaded_here


def _has_tokenizer(source: str) -> bool:
    p = Path(source)
    if not p.is_dir():
        return True  # a hub id: its tokenizer lives beside the model
    return any(
        (p / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    )


def _disable_dropout(model: nn.Module) -> None:
    for mod in model.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0


def _checked_options(config: TrainConfig) -> tuple[float, float]:
    """(beta, label_smoothing) once loss_type, beta, label_smoothing and max_len are valid."""
    m, r = config.model, config.recipe
    if r["loss_type"] not in LOSS_TYPES:
        raise ConfigError(f"recipe.loss_type: {r['loss_type']!r}; allowed: {', '.join(LOSS_TYPES)}")
    beta, eps = float(r["beta"]), float(r["label_smoothing"])
    if not (math.isfinite(beta) and beta > 0):
        raise ConfigError(f"recipe.beta: {beta}; allowed: a number > 0")
    if not 0 <= eps < 0.5:
        raise ConfigError(f"recipe.label_smoothing: {eps}; allowed: 0 <= value < 0.5")
    if m["max_len"] < 2:
        raise ConfigError(f"model.max_len: {m['max_len']}; allowed: at least 2 tokens")
    return beta, eps


def build(config: TrainConfig) -> Built:
    """Pairs, policy, frozen reference, step and hooks. Left whole past 60 lines: the
    epoch summary and the final/hf export close over the tokenizer and model config it
    loads, as every recipe's ``build`` does."""
    m, r = config.model, config.recipe
    beta, eps = _checked_options(config)
    pairs = load_pairs(r["train_data"] or DATA_DIR / "dpo_pairs.json", "recipe.train_data")
    if r["val_data"]:
        val = load_pairs(r["val_data"], "recipe.val_data")
    else:
        n_val = int(len(pairs) * r["val_fraction"])
        val, pairs = pairs[:n_val], pairs[n_val:]
        if not pairs:
            raise ConfigError("recipe.val_fraction: leaves no training pairs")

    policy, tok, init_done = load_policy(config)
    hf_config = copy.deepcopy(policy.config)
    max_len = m["max_len"]
    limit = getattr(hf_config, "max_position_embeddings", None) or getattr(
        hf_config, "n_positions", None
    )
    if isinstance(limit, int) and 1 < limit < max_len:
        log.warning(
            "model.max_len %d: the model has %d positions; sequences are cut at %d",
            max_len,
            limit,
            limit,
        )
        max_len = limit
    if r["disable_dropout"]:
        _disable_dropout(policy)
    policy.train()
    reference = Reference(policy)  # the starting policy, frozen: same on every rank
    train_ds = PairDataset(pairs, tok, max_len, "recipe.train_data")
    val_ds = PairDataset(val, tok, max_len, "recipe.val_data") if val else None
    collate = make_collate(int(tok.pad_token_id))
    if r["precompute_ref_logps"]:
        stored_ref_logps(
            reference,
            (train_ds, val_ds),
            collate,
            max(1, config.training.batch_size),
            config.checkpoint.dir,
        )
        reference.model = None  # freed: the stored log-probs stand for it
    ctx = ddp.get_context()
    world = ctx.world_size if ctx is not None else 1
    if _main():
        print(f"Loaded {len(train_ds)} training and {len(val_ds or [])} validation pairs")
        print(
            f"Batch size per GPU: {config.training.batch_size}, "
            f"Total batch size: {config.training.batch_size * world}",
            flush=True,
        )
    step = make_step(reference, beta, r["loss_type"], eps)

    def epoch_end(epoch: int, epochs: int, train_loss: float, ev: dict[str, float]) -> None:
        if _main():  # the seed's epoch summary, as its run_dpo_ddp.py prints it
            lines = [f"Epoch {epoch + 1} Summary:", f"  Train Loss: {train_loss:.4f}"]
            if "eval_loss" in ev:
                lines.append(f"  Val Loss:   {ev['eval_loss']:.4f}")
            print("\n".join(lines), flush=True)

    def after_fit(trainer: Any, summary: dict[str, Any]) -> None:
        """Beside final/model.pt: final/hf, a folder that from_pretrained loads. Built
        from the export (a full state dict, also under FSDP, where the live policy is
        sharded and its own state_dict a collective), by rank 0 alone."""
        final = summary.get("final_model")
        if not final or not _main():
            return
        tf = _transformers()
        state = torch.load(final, map_location="cpu", weights_only=True)
        model = tf.AutoModelForCausalLM.from_config(
            hf_config, trust_remote_code=bool(m["trust_remote_code"]), dtype=torch.float32
        )
        model.load_state_dict(state)
        model.save_pretrained(Path(final).parent / "hf")
        tok.save_pretrained(Path(final).parent / "hf")

    built = Built(policy, train_ds, val_ds, _train_step(step), step, collate, after_fit)
    built.init_done = init_done
    built.on_epoch_end = epoch_end
    built.reference = reference  # type: ignore[attr-defined]  # tests read it
    return built
