"""Pieces shared by the protein recipes: amino-acid tokenizer and a tiny transformer."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

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


class TinyTransformer(nn.Module):
    """Pre-norm transformer over token ids; bidirectional, or causal for the DPO policy.

    ``time_conditioned`` adds a learned embedding of the diffusion time t in [0, 1].
    ``gradient_checkpointing`` (set by ``memory.gradient_checkpointing``) recomputes
    each layer in backward to save activation memory.
    """

    def __init__(
        self,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        max_len: int = 128,
        dropout: float = 0.0,
        causal: bool = False,
        time_conditioned: bool = False,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.tok = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        self.time = nn.Linear(1, d_model) if time_conditioned else None
        # Bidirectional models get a local convolution (as in CARP/ByteNet protein LMs):
        # neighbouring residues carry most of the signal and attention finds them slowly.
        self.conv = None if causal else nn.Conv1d(d_model, d_model, 5, padding=2)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=True
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        self.gradient_checkpointing = False

    def forward(self, tokens: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.tok(tokens) + self.pos[:length]
        if self.time is not None and t is not None:
            h = h + self.time(t.view(-1, 1, 1).to(h.dtype))
        if self.conv is not None:
            h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        mask = (
            torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
            if self.causal
            else None
        )
        pad = tokens == PAD
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                h = checkpoint(layer, h, mask, pad, use_reentrant=False)
            else:
                h = layer(h, src_mask=mask, src_key_padding_mask=pad)
        return self.head(self.norm(h))
