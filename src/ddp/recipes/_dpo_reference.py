"""The dpo recipe's frozen reference model and its log-probs computed once
(``recipe.precompute_ref_logps``), kept in ``<checkpoint.dir>/ref_logps.pt`` for a
resumed or repeated run.

Split from :mod:`ddp.recipes.dpo` (the recipe: model, loss, ``build``), which
re-exports these names.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddp
from ddp.recipes._dpo_data import PairDataset
from ddp.recipes._dpo_loss import sequence_logps

log = logging.getLogger("ddp")


class Reference:
    """The frozen reference: never a parameter of the wrapped policy (DDP never sees it),
    eval mode, no gradients; moved to the batch's device when first used."""

    def __init__(self, policy: nn.Module) -> None:
        self.model: nn.Module | None = copy.deepcopy(policy).requires_grad_(False).eval()

    @torch.no_grad()
    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        assert self.model is not None, "the reference was freed after precomputing"
        dev = batch["input_ids"].device
        if next(self.model.parameters()).device != dev:
            self.model.to(dev)
        self.model.eval()
        return sequence_logps(self.model, batch)[0]


def _main() -> bool:
    ctx = ddp.get_context()
    return ctx is None or ctx.is_main


@torch.no_grad()
def precompute(reference: Reference, data: PairDataset, collate: Any, batch: int) -> None:
    """Reference log-probs of every pair, stored with the data (``ref`` per item).

    On this rank's device when the run has one (the reference follows the batch there);
    every rank computes every pair, so no rank waits on another's shard."""
    ctx = ddp.get_context()
    dev = ctx.device if ctx is not None else torch.device("cpu")
    out = []
    for lo in range(0, len(data), batch):
        items = [data[i] for i in range(lo, min(lo + batch, len(data)))]
        cpu = collate(items)
        lp = reference.logps({k: v.to(dev) for k, v in cpu.items()})
        out.append(lp.view(2, -1).T.cpu())
    data.ref = torch.cat(out)


REF_CACHE = "ref_logps.pt"


def _ref_key(reference: nn.Module, datasets: tuple[PairDataset | None, ...]) -> str:
    """What the stored log-probs depend on: the reference's weights (names, shapes and up
    to 1024 evenly spaced values of each tensor: cheap for a large model, and any other
    checkpoint differs in them) and every token row with its prompt length."""
    import hashlib

    h = hashlib.sha256()
    for k, v in reference.state_dict().items():
        flat = v.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 1024)][:1024]
        h.update(f"{k}{tuple(v.shape)}{v.dtype}".encode())
        h.update(sample.float().cpu().numpy().tobytes())
    for ds in datasets:
        h.update(json.dumps(ds.items if ds is not None else None).encode())
    return h.hexdigest()


def stored_ref_logps(
    reference: Reference,
    datasets: tuple[PairDataset | None, ...],
    collate: Any,
    batch: int,
    directory: str | None,
) -> None:
    """Reference log-probs for every dataset, read from ``<checkpoint.dir>/ref_logps.pt``
    when it was written for this reference and these token rows (a resumed or repeated
    run), else computed (:func:`precompute`) and written there by rank 0, atomically."""
    import io

    from ddp import checkpoint as ckpt

    assert reference.model is not None
    key = _ref_key(reference.model, datasets)
    path = Path(directory) / REF_CACHE if directory else None
    if path is not None and path.is_file():
        try:
            saved = torch.load(io.BytesIO(ckpt.read_regular(path, None)), weights_only=True)
            tensors = [saved[f"ref{i}"] for i in range(len(datasets))]
            ok = saved.get("key") == key and all(
                (t is None) == (ds is None)
                and (
                    ds is None
                    or (
                        isinstance(t, torch.Tensor)
                        and t.shape == (len(ds), 2)
                        and bool(torch.isfinite(t).all())
                    )
                )
                for t, ds in zip(tensors, datasets, strict=True)
            )
        except Exception:  # damaged, foreign or crafted: computed afresh
            ok = False
        if ok:
            for t, ds in zip(tensors, datasets, strict=True):
                if ds is not None:
                    ds.ref = t.float()
            log.info("reference log-probs read from %s", path)
            return
        log.warning("%s was written for another reference or data; computing afresh", path)
    for ds in datasets:
        if ds is not None:
            precompute(reference, ds, collate, batch)
    if path is not None and _main():
        obj: dict[str, Any] = {"key": key}
        obj.update({f"ref{i}": ds.ref if ds is not None else None for i, ds in enumerate(datasets)})
        ckpt.atomic_save(obj, path)
