"""Pieces shared by the protein recipes: the amino-acid tokenizer."""

from __future__ import annotations

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
SPECIALS = ("<pad>", "<mask>", "<bos>", "<eos>", "<unk>")
PAD, MASK, BOS, EOS, UNK = range(len(SPECIALS))
VOCAB = len(SPECIALS) + len(AMINO_ACIDS)
_INDEX = {a: i + len(SPECIALS) for i, a in enumerate(AMINO_ACIDS)}


def encode(seq: str) -> list[int]:
    """Residues to token ids; anything outside the 20 standard amino acids is ``<unk>``."""
    return [_INDEX.get(c, UNK) for c in seq.upper()]


def decode(ids: list[int]) -> str:
    return "".join(AMINO_ACIDS[i - len(SPECIALS)] if i >= len(SPECIALS) else "?" for i in ids)
