"""The distill recipe's models: loading a SentenceTransformer (teacher or student, hub id
or folder), the student with its seeded Dense head in projection mode or its MRL prefix
widths, and the loss its ``forward`` returns.

Split from :mod:`ddp.recipes.distill` (data, evaluation, ``build``, export), which
re-exports these names; its inputs and teacher cache live in :mod:`ddp.recipes._distill_io`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ddp.config import TrainConfig
from ddp.errors import ConfigError
from ddp.recipes import seeded_model
from ddp.recipes._distill_io import EXTRA


def _require() -> Any:
    """sentence-transformers, or one line naming the extra to install."""
    try:
        import sentence_transformers
    except ImportError:
        raise ConfigError(f"the distill recipe needs sentence-transformers: {EXTRA}") from None
    return sentence_transformers


def load_st(name: str, config: TrainConfig, dtype: str = "float32") -> Any:
    """``SentenceTransformer(name)``: the one path for hub ids and local folders."""
    st = _require()
    kwargs: dict[str, Any] = {}
    if dtype != "float32":
        kwargs["dtype"] = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        model = st.SentenceTransformer(
            name,
            device="cpu",
            trust_remote_code=bool(config.recipe["trust_remote_code"]),
            model_kwargs=kwargs or None,
        )
    except (OSError, ValueError) as exc:  # a missing folder, an unknown hub id, offline
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot load SentenceTransformer {name!r}: {first}"[:400]) from None
    max_len = config.model["max_seq_length"]
    if max_len is not None:
        model.max_seq_length = int(max_len)
    return model


def tokenize(st: Any, texts: list[str]) -> dict[str, Any]:
    """Features for ``texts`` from the model's own tokenizer (``preprocess`` since 6.0)."""
    fn = getattr(st, "preprocess", None) or st.tokenize
    return dict(fn(texts))


def _dense(in_features: int, out_features: int) -> nn.Module:
    import importlib

    # Dense's home by version, imported by name: a type checker sees only one version
    try:
        cls = importlib.import_module("sentence_transformers.sentence_transformer.modules").Dense
    except (ImportError, AttributeError):  # sentence-transformers < 6
        cls = importlib.import_module("sentence_transformers.models").Dense
    dense: nn.Module = cls(in_features, out_features, activation_function=nn.Identity())
    return dense


def _width(st: Any) -> int:
    get = getattr(st, "get_embedding_dimension", None) or st.get_sentence_embedding_dimension
    return int(get())


class DistillModel(nn.Module):
    """The student SentenceTransformer (with its Dense head in projection mode).

    ``forward(batch)`` returns the training loss, so the Trainer's default step and DDP
    wrap it unchanged; :meth:`embed` is what ``encode()`` of the export computes.
    """

    def __init__(self, st: Any, use_projection: bool, mrl_dims: list[int]) -> None:
        super().__init__()
        self.st = st
        self.use_projection = use_projection
        self.mrl_dims = mrl_dims

    def embed(self, features: dict[str, Any]) -> torch.Tensor:
        return self.st(dict(features))["sentence_embedding"]

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        s = self.embed(batch["features"]).float()
        t = batch["teacher"].float()
        if self.use_projection:
            cos = F.cosine_similarity(s, t, dim=-1)
            return {"loss": (1 - cos).mean(), "cos": cos.mean().detach()}
        t_sim = _sim(t, t)
        losses = [F.mse_loss(_sim(s[:, :m], s[:, :m]), t_sim) for m in self.mrl_dims]
        return {"loss": torch.stack(losses).mean(), "sim_mse": losses[0].detach()}


def _sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def mrl_dims(given: list[Any], width: int) -> list[int]:
    """The MRL prefix widths, widest first; derived (halvings down to 8) when empty."""
    if not given:
        dims: list[int] = []
        d = width
        while d >= 8 and len(dims) < 5:
            dims.append(d)
            d //= 2
        return dims or [width]
    if not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= width for d in given):
        raise ConfigError(
            f"model.mrl_dims: {given!r}; allowed: widths in [1, {width}] "
            "(the student's embedding width)"
        )
    return sorted(set(given), reverse=True)


def make_student(config: TrainConfig, teacher_dim: int) -> DistillModel:
    """The student as loaded, plus a seeded Dense head in projection mode."""

    def make() -> DistillModel:
        st = load_st(config.recipe["student_model"], config)
        width = _width(st)
        use_proj = bool(config.model["use_projection"])
        if use_proj:
            # Before a Normalize module, if the student has one: the head maps the pooled
            # embedding, and the exported model still returns unit vectors.
            mods = list(st)
            at = next((i for i, m in enumerate(mods) if type(m).__name__ == "Normalize"), len(mods))
            mods.insert(at, _dense(width, teacher_dim))
            st = type(st)(modules=mods, device="cpu")
        dims = [] if use_proj else mrl_dims(list(config.model["mrl_dims"]), width)
        return DistillModel(st, use_proj, dims)

    return seeded_model(config.training.seed, make)
