"""Tiny real models and data for the dpo and init_from tests, built locally (no download).

A GPT-2-like causal LM (``GPT2Config`` -> ``GPT2LMHeadModel`` -> ``save_pretrained``)
and a byte-pair tokenizer trained on a few lines with ``tokenizers``, wrapped in
``PreTrainedTokenizerFast``: the folder is what a hub id resolves to, so the recipe
takes the same ``from_pretrained`` path as for a real model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

AA = "ACDEFGHIKLMNPQRSTVWY"

# A 4-residue chain A (and a 2-residue chain B) in PDB format: N, CA, C, O per residue.
_RES = [
    ("MET", "A", 1),
    ("LYS", "A", 2),
    ("TRP", "A", 3),
    ("VAL", "A", 4),
    ("GLY", "B", 1),
    ("SER", "B", 2),
]


def write_pdb(path: Path) -> str:
    """A tiny PDB file; returns chain A's one-letter sequence."""
    lines, serial = [], 1
    for k, (name, chain, num) in enumerate(_RES):
        for j, atom in enumerate(("N", "CA", "C", "O")):
            x, y, z = 1.5 * k + 0.3 * j, 0.2 * j, 0.1 * k
            lines.append(
                f"ATOM  {serial:5d}  {atom:<3s} {name} {chain}{num:4d}    "
                f"{x:8.3f}{y:8.3f}{z:8.3f}  1.00  0.00           {atom[0]}"
            )
            serial += 1
    lines += ["TER", "END"]
    path.write_text("\n".join(lines) + "\n")
    return "MKWV"


def make_tiny_lm(folder: Path, n_embd: int = 32, seed: int = 0) -> Path:
    """A tiny GPT-2 and its locally trained tokenizer, saved as a Hugging Face folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    rng = random.Random(seed)
    lines = ["".join(rng.choice(AA) for _ in range(rng.randint(5, 12))) for _ in range(60)]
    lines += ["the protein folds", "a chain of residues", "prefer the chosen one"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        lines, trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<eos>", "<unk>"])
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
        n_positions=64,
        n_embd=n_embd,
        n_layer=2,
        n_head=2,
        bos_token_id=fast.eos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def write_pairs(path: Path, n: int, seed: int = 0, structure: str | None = None) -> Path:
    """``n`` pairs in the seed's format (chosen: the reversed prompt, rejected: random);
    with ``structure``, one more record that names that PDB file instead of a prompt."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        p = "".join(rng.choice(AA) for _ in range(rng.randint(4, 8)))
        pairs.append(
            {"prompt": p, "chosen": p[::-1], "rejected": "".join(rng.choice(AA) for _ in p)}
        )
    if structure is not None:
        pairs.append({"structure": structure, "chain": "A", "chosen": "VWKM", "rejected": "GGSS"})
    path.write_text(json.dumps(pairs))
    return path
