"""The SEDD network (:mod:`ddp.sedd`): a DiT-style transformer over token states,
conditioned on the total noise ``sigma_bar`` through sinusoidal features and adaptive layer
norm, with rotary positions; SEDD small is ``DiT(n, 768, 12, 12, cond_dim=128)``.

Split from :mod:`ddp.sedd` (graphs, schedules, losses, samplers), which re-exports these
names; the model knows nothing of the graph it is trained on, only its number of states.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddp.errors import ConfigError


class NoiseEmbedding(nn.Module):
    """Sinusoidal features of sigma_bar, then an MLP: the DiT's timestep embedder."""

    def __init__(self, dim: int, freqs: int = 256) -> None:
        super().__init__()
        self.freqs = freqs
        self.mlp = nn.Sequential(nn.Linear(freqs, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, sigma: torch.Tensor) -> torch.Tensor:
        half = self.freqs // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, device=sigma.device) / half)
        a = sigma.float()[:, None] * f[None]
        return self.mlp(
            torch.cat([torch.cos(a), torch.sin(a)], -1).to(
                cast(nn.Linear, self.mlp[0]).weight.dtype
            )
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat([-b, a], -1) * sin


class DiTBlock(nn.Module):
    """Pre-norm attention and MLP, each modulated (shift, scale) and gated by the noise
    embedding through a zero-initialised projection (adaLN-Zero), so a block starts as
    the identity."""

    def __init__(self, dim: int, heads: int, cond: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim)
        )
        self.ada = nn.Linear(cond, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)
        self.dropout = dropout

    def forward(
        self, x: torch.Tensor, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        b, length, d = x.shape
        sh1, sc1, g1, sh2, sc2, g2 = self.ada(c)[:, None].chunk(6, -1)
        h = self.norm1(x) * (1 + sc1) + sh1
        q, k, v = self.qkv(h).view(b, length, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        x = x + g1 * F.dropout(self.proj(a.transpose(1, 2).reshape(b, length, d)), p)
        h = self.norm2(x) * (1 + sc2) + sh2
        return x + g2 * F.dropout(self.mlp(h), p)


class DiT(nn.Module):
    """The SEDD network: token embedding, rotary positions, ``n_layers`` adaLN blocks
    conditioned on sigma_bar, and a zero-initialised output layer giving ``n_states``
    numbers per position (raw log-scores or logits; see :func:`log_score`).

    SEDD small is ``DiT(n, 768, 12, 12, cond_dim=128)``. ``gradient_checkpointing``
    (set by ``memory.gradient_checkpointing``) recomputes each block in backward.
    """

    cos: torch.Tensor  # the rotary tables, buffers (register_buffer)
    sin: torch.Tensor

    def __init__(
        self,
        n_states: int,
        d_model: int = 768,
        n_layers: int = 12,
        n_heads: int = 12,
        cond_dim: int = 128,
        max_len: int = 1024,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ConfigError(
                f"model.n_heads: {n_heads} must divide model.d_model: {d_model} "
                "into an even head width (rotary positions rotate pairs)"
            )
        self.max_len = max_len
        self.embed = nn.Embedding(n_states, d_model)
        self.sigma = NoiseEmbedding(cond_dim)
        self.blocks = nn.ModuleList(
            DiTBlock(d_model, n_heads, cond_dim, dropout) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.ada = nn.Linear(cond_dim, 2 * d_model)
        self.out = nn.Linear(d_model, n_states)
        for lin in (self.ada, self.out):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        hd = d_model // n_heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(max_len).float(), inv)
        ang = torch.cat([ang, ang], -1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor, sigma_bar: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        h = self.embed(x)
        c = F.silu(self.sigma(sigma_bar))
        cos, sin = self.cos[:length].to(h.dtype), self.sin[:length].to(h.dtype)
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                h = checkpoint(block, h, c, cos, sin, use_reentrant=False)
            else:
                h = block(h, c, cos, sin)
        shift, scale = self.ada(c)[:, None].chunk(2, -1)
        return self.out(self.norm(h) * (1 + scale) + shift)
