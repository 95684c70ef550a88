"""The dpo recipe's loss: completion log-probs, TRL's four DPO losses with their reward
metrics, and the step functions the Trainer calls.

Split from :mod:`ddp.recipes.dpo` (the recipe: model, reference, ``build``), which
re-exports these names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddp.errors import ConfigError

if TYPE_CHECKING:
    from ddp.recipes._dpo_reference import Reference


LOSS_TYPES = ("sigmoid", "conservative", "robust", "ipo")


def sequence_logps(
    lm: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log p of the completion tokens, completion token count) per row."""
    out = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    logits = out.logits[:, :-1].float()
    target = batch["input_ids"][:, 1:]
    mask = batch["loss_mask"][:, 1:]
    lp = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum(-1), mask.sum(-1)


def dpo_loss(
    pi: torch.Tensor,
    ref: torch.Tensor,
    n_tokens: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> dict[str, torch.Tensor]:
    """The loss and reward metrics from (B, 2) policy and reference log-probs
    (column 0 chosen, 1 rejected) and (B, 2) completion token counts."""
    f = nn.functional
    ratios = pi - ref  # (B, 2): log pi/ref of chosen, rejected
    delta = ratios[:, 0] - ratios[:, 1]
    eps = label_smoothing
    if loss_type == "sigmoid":
        per = -f.logsigmoid(beta * delta)
    elif loss_type == "conservative":
        per = -(1 - eps) * f.logsigmoid(beta * delta) - eps * f.logsigmoid(-beta * delta)
    elif loss_type == "robust":
        per = (-(1 - eps) * f.logsigmoid(beta * delta) + eps * f.logsigmoid(-beta * delta)) / (
            1 - 2 * eps
        )
    elif loss_type == "ipo":
        avg = ratios / n_tokens.clamp(min=1)
        per = (avg[:, 0] - avg[:, 1] - 1 / (2 * beta)) ** 2
    else:
        raise ConfigError(f"recipe.loss_type: {loss_type!r}; allowed: {', '.join(LOSS_TYPES)}")
    rewards = beta * ratios.detach()
    return {
        "loss": per.mean(),
        "reward_chosen": rewards[:, 0].mean(),
        "reward_rejected": rewards[:, 1].mean(),
        "reward_margin": (rewards[:, 0] - rewards[:, 1]).mean(),
        "reward_acc": (rewards[:, 0] > rewards[:, 1]).float().mean(),
    }


def make_step(reference: Reference, beta: float, loss_type: str, eps: float) -> Any:
    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pi, n = sequence_logps(model, batch)
        b = pi.shape[0] // 2
        ref = batch["ref_logps"] if "ref_logps" in batch else reference.logps(batch).view(2, b).T
        out = dpo_loss(pi.view(2, b).T, ref.to(pi.dtype), n.view(2, b).T, beta, loss_type, eps)
        out["n"] = torch.tensor(float(b))  # pairs: evaluation weighs each batch by it
        return out

    return step


def _train_step(step: Any) -> Any:
    def train(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = step(model, batch)
        out.pop("n")
        return out

    return train
