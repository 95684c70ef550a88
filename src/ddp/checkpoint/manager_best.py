"""The best model of the :class:`~ddp.checkpoint.manager.Checkpointer` (seed 002's
``best_model.pt``): ``best/model.pt`` kept each time ``checkpoint.best``'s metric
improves, and its value read back by a resumed run."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ddp
from ddp import checkpoint as ckpt
from ddp import fsdp
from ddp.checkpoint.manager_base import CheckpointerBase
from ddp.errors import ConfigError

log = logging.getLogger("ddp")


class Best(CheckpointerBase):
    """``checkpoint.best``: keep the best evaluation's weights."""

    BEST = "best"
    BEST_ALIAS = "best_model.pt"
    BEST_META = "best.json"

    def keep_best(
        self, model: torch.nn.Module, metrics: dict[str, float], global_step: int
    ) -> str | None:
        """Collective at an evaluation: ``best/model.pt`` when ``checkpoint.best``'s
        metric improved; returns its path, or None when nothing was written.

        The decision needs no message between ranks: ``metrics`` come from the
        evaluation's one all-reduce, so every rank holds the same numbers and takes the
        same decision (the write, and the sharded model's gather, are then collectives
        every rank joins). Rank 0 writes ``best/model.pt`` and ``best/config.yaml`` in
        ``final/``'s format (atomic, like :func:`ddp.checkpoint.export_final`), then
        ``best/best.json`` (metric, value, step), which a resumed run reads back so a
        worse evaluation after a restart never replaces the best; the seed's
        ``best_model.pt`` is a link to ``best/model.pt``. Only an improvement costs a
        message: the write's error (a full disk) is broadcast so every rank stops with
        the same line, as the seed's barrier after ``save_checkpoint('best_model.pt')``.
        """
        b = self.config.checkpoint.best
        if not (self.dir and b.metric) or not metrics:
            return None
        key = best_key(b.metric)
        if key not in metrics:
            known = ", ".join("eval/" + k[len("eval_") :] for k in sorted(metrics))
            raise ConfigError(
                f"checkpoint.best.metric: {b.metric!r} is not a metric this "
                f"run evaluates; allowed: {known}"
            )
        if self.best is None:  # once per run: what a resumed run had kept
            self.best = BestValue(key, b.mode)
            if self.resumed_from:
                self.best.load_state_dict(self._read_best())
        value = float(metrics[key])
        if not self.best.improves(value):
            return None
        self.best.value, self.best.step = value, global_step
        full = fsdp.full_state_dict(model) if fsdp.is_sharded(model) else None  # collective
        path, error = None, None
        if self.ctx.is_main:
            try:
                path = str(self._write_best(model, full))
            except OSError as exc:
                error = str(ckpt.save_error(Path(self.dir), self.BEST, exc))
            else:
                log.info("best model: %s=%.6g at step %d -> %s", key, value, global_step, path)
        path, error = ddp.broadcast_object((path, error))
        if error:
            raise ConfigError(error)
        return path

    def _write_best(self, model: torch.nn.Module, full: dict[str, torch.Tensor] | None) -> Path:
        best = self._directory() / self.BEST
        source = ckpt.model_state(model) if full is None else full
        state = {k: v.detach().to("cpu").clone() for k, v in source.items()}
        path = best / "model.pt"
        ckpt.atomic_save(state, path)
        ckpt.atomic_write_text(self.config.to_yaml(), best / "config.yaml")
        assert self.best is not None  # keep_best's: the value just improved
        ckpt.atomic_write_text(json.dumps(self.best.state_dict()) + "\n", best / self.BEST_META)
        alias = self._directory() / self.BEST_ALIAS
        if not alias.is_symlink():  # a link stays right: it names best/model.pt
            try:  # relative, so the checkpoint folder may move
                if alias.exists():
                    raise OSError("a copy from an earlier write")
                alias.symlink_to(Path(self.BEST) / "model.pt")
            except OSError:  # no symlinks here (Windows without the privilege): a copy
                ckpt.atomic_save(state, alias)
        return path

    def _read_best(self) -> dict[str, Any]:
        """Rank 0 reads ``best/best.json`` (untrusted: a small regular file); every rank
        gets its content ({} when absent or damaged), for :meth:`BestValue.load_state_dict`
        to check."""
        meta: Any = {}
        if self.ctx.is_main:
            path = self._directory() / self.BEST / self.BEST_META
            try:
                meta = json.loads(ckpt.read_regular(path))
            except (ValueError, OSError):  # absent or damaged: start afresh
                meta = {}
        meta = ddp.broadcast_object(meta)
        return meta if isinstance(meta, dict) else {}


@dataclass
class BestValue:
    """``checkpoint.best``'s counter: the best value of ``metric`` so far and its step,
    in the ``Stateful`` shape; its ``state_dict()`` is ``best/best.json``'s content."""

    metric: str  # the key evaluate() returns (eval_loss)
    mode: str  # min | max
    value: float | None = None  # None: the next finite evaluation is the best
    step: int = 0

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best so far (NaN and inf never do)."""
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value < self.value if self.mode == "min" else value > self.value

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the saved best only where it compares: the same metric and mode and a
        finite number (untrusted file); otherwise start afresh (value None)."""
        value = state_dict.get("value")
        step = state_dict.get("step")
        if (
            state_dict.get("metric") == self.metric
            and state_dict.get("mode") == self.mode
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        ):
            self.value = float(value)
            self.step = step if type(step) is int and step >= 0 else 0
        else:
            self.value, self.step = None, 0


def best_key(metric: str) -> str:
    """``eval/loss`` (the seeds' W&B spelling) or ``eval_loss`` -> ``eval_loss``, the
    key :meth:`ddp.trainer.Trainer.evaluate` returns."""
    name = metric.removeprefix("eval/").removeprefix("eval_")
    return f"eval_{name}"
