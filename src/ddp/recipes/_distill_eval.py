"""The distill recipe's evaluation: the cosine to the teacher, the similarity gap to
anchor texts per prefix width, and recall@k and MRR of each query's positive.

Split from :mod:`ddp.recipes.distill` (data, ``build``, export), which re-exports these
names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from ddp.recipes._distill_model import DistillModel, _sim, tokenize

if TYPE_CHECKING:
    from ddp.recipes.distill import TextSet


class _PerWeights:
    """Embeddings of fixed texts, recomputed only when the student's weights changed.

    The Trainer calls the eval step per batch; the anchors and the retrieval corpus are
    the same for every batch, so they are embedded once per evaluation. Each optimizer
    step bumps the parameters' in-place version counters, which is the key."""

    def __init__(self, texts: list[str], batch_size: int) -> None:
        self.texts, self.batch_size = texts, batch_size
        self.key: Any = None
        self.value: torch.Tensor | None = None

    def get(self, model: DistillModel, device: torch.device) -> torch.Tensor:
        params = list(model.parameters())
        key = (id(model), str(device), tuple(p._version for p in params[:1] + params[-1:]))
        if key != self.key or self.value is None:
            parts = []
            for i in range(0, len(self.texts), self.batch_size):
                feats = tokenize(model.st, self.texts[i : i + self.batch_size])
                feats = {
                    k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in feats.items()
                }
                parts.append(model.embed(feats).float())
            self.key, self.value = key, torch.cat(parts)
        return self.value


def make_eval_fn(val: TextSet, n_anchors: int, recall_at: list[int], batch_size: int) -> Any:
    """Per-query means (the Trainer sums them exactly across ranks)."""
    k = min(n_anchors, len(val))
    anchors = _PerWeights(val.texts[:k], batch_size)
    docs = _PerWeights(val.positives, batch_size) if val.positives is not None else None
    assert val.teacher is not None
    t_anchor = val.teacher[:k].float()

    def eval_fn(model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        assert isinstance(model, DistillModel)
        s = model.embed(batch["features"]).float()
        t = batch["teacher"].float()
        dev = s.device
        out: dict[str, torch.Tensor] = {"n": torch.tensor(float(s.shape[0]))}
        if s.shape[1] == t.shape[1]:
            out["cos"] = F.cosine_similarity(s, t, dim=-1).mean()
        a = anchors.get(model, dev)
        t_gap = _sim(t, t_anchor.to(dev))
        for m in model.mrl_dims or [s.shape[1]]:
            gap = (_sim(s[:, :m], a[:, :m]) - t_gap).pow(2).mean(1).mean()
            out["sim_mse" if not model.mrl_dims else f"sim_mse@{m}"] = gap
        if docs is not None:
            scores = _sim(s, docs.get(model, dev))
            idx = batch["index"].to(dev)
            true = scores.gather(1, idx[:, None])
            rank = (scores > true).sum(1).float()
            for kk in recall_at:
                out[f"recall@{kk}"] = (rank < kk).float().mean()
            out["mrr"] = (1 / (rank + 1)).mean()
        return out

    return eval_fn
