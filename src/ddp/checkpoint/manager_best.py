"""The best model of the :class:`~ddp.checkpoint.manager.Checkpointer` (seed 002's
``best_model.pt``): ``best/model.pt`` kept each time ``checkpoint.best``'s metric
improves, and its value read back by a resumed run."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

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
        if not self._best_read:  # once per run: what a resumed run had kept
            self._best = self._read_best(key) if self.resumed_from else None
            self._best_read = True
        value = float(metrics[key])
        if not math.isfinite(value):
            return None
        if self._best is not None and not (
            value < self._best if b.mode == "min" else value > self._best
        ):
            return None
        self._best = value
        full = fsdp.full_state_dict(model) if fsdp.is_sharded(model) else None  # collective
        path, error = None, None
        if self.ctx.is_main:
            try:
                path = str(self._write_best(model, full, key, value, global_step))
            except OSError as exc:
                error = str(ckpt.save_error(Path(self.dir), self.BEST, exc))
            else:
                log.info("best model: %s=%.6g at step %d -> %s", key, value, global_step, path)
        path, error = ddp.broadcast_object((path, error))
        if error:
            raise ConfigError(error)
        return path

    def _write_best(
        self,
        model: torch.nn.Module,
        full: dict[str, torch.Tensor] | None,
        key: str,
        value: float,
        step: int,
    ) -> Path:
        best = self._directory() / self.BEST
        source = ckpt.model_state(model) if full is None else full
        state = {k: v.detach().to("cpu").clone() for k, v in source.items()}
        path = best / "model.pt"
        ckpt.atomic_save(state, path)
        ckpt.atomic_write_text(self.config.to_yaml(), best / "config.yaml")
        meta = {
            "metric": key,
            "mode": self.config.checkpoint.best.mode,
            "value": value,
            "step": step,
        }
        ckpt.atomic_write_text(json.dumps(meta) + "\n", best / self.BEST_META)
        alias = self._directory() / self.BEST_ALIAS
        if not alias.is_symlink():  # a link stays right: it names best/model.pt
            try:  # relative, so the checkpoint folder may move
                if alias.exists():
                    raise OSError("a copy from an earlier write")
                alias.symlink_to(Path(self.BEST) / "model.pt")
            except OSError:  # no symlinks here (Windows without the privilege): a copy
                ckpt.atomic_save(state, alias)
        return path

    def _read_best(self, key: str) -> float | None:
        """Rank 0 reads ``best/best.json`` (untrusted: small regular file, JSON checked);
        every rank gets its value. A file for another metric or mode is not comparable:
        None (the next evaluation becomes the best)."""
        value = None
        if self.ctx.is_main:
            path = self._directory() / self.BEST / self.BEST_META
            try:
                meta = json.loads(ckpt.read_regular(path))
                if (
                    isinstance(meta, dict)
                    and meta.get("metric") == key
                    and meta.get("mode") == self.config.checkpoint.best.mode
                    and isinstance(meta.get("value"), int | float)
                    and math.isfinite(meta["value"])
                ):
                    value = float(meta["value"])
            except (ValueError, OSError):  # absent or damaged: start afresh
                value = None
        return ddp.broadcast_object(value)


def best_key(metric: str) -> str:
    """``eval/loss`` (the seeds' W&B spelling) or ``eval_loss`` -> ``eval_loss``, the
    key :meth:`ddp.trainer.Trainer.evaluate` returns."""
    name = metric.removeprefix("eval/").removeprefix("eval_")
    return f"eval_{name}"
