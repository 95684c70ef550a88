"""Trainer: the DDP training loop written once (sampler epochs, accumulation, AMP,
clipping, warmup + schedule, exact evaluation, checkpoints, preemption, failure).

The hot loop is kept close to a hand-written DDP loop: no ``.item()`` except every
``logging.every_n_steps``, no per-step allocations (losses accumulate in place into
one preallocated tensor), ``zero_grad(set_to_none=True)``, ``no_sync()`` only when
accumulating, and no autocast context at all in fp32.

Exit codes: a preempted run saves one consistent checkpoint and raises
:class:`Preempted` (``SystemExit`` with :data:`PREEMPTED_EXIT_CODE` = 75, the BSD
``EX_TEMPFAIL``: "try again later"). A failure on one rank of a multi-rank job
prints ``rank N failed: ...`` to stderr and ends that process with exit code 1 at
once (``os._exit``); the peers' next collective then fails on the closed socket,
so the whole job ends in seconds instead of waiting out the collective timeout.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

import ddp
from ddp import checkpoint as ckpt
from ddp.config import TrainConfig
from ddp.errors import ConfigError, TrainingDiverged
from ddp.preemption import SignalWatch

log = logging.getLogger("ddp")

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run that stopped on a preemption signal after saving a checkpoint."""

StepFn = Callable[[torch.nn.Module, Any], Any]


class Preempted(SystemExit):
    """Raised by :meth:`Trainer.fit` after the preemption checkpoint is saved."""

    def __init__(self) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)


def _default_step(model: torch.nn.Module, batch: Any) -> Any:
    return model(batch)


class _ResumableSampler(DistributedSampler):
    """DistributedSampler that can start ``start`` samples into this rank's epoch order.

    The order itself is DistributedSampler's (seed + epoch), so skipping the first
    ``start`` indices gives exactly the batches an uninterrupted run would still see.
    """

    start: int = 0

    def __iter__(self) -> Iterator[int]:
        it = super().__iter__()
        if self.start:
            for _ in range(self.start):
                next(it, None)
        return it

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


@dataclass
class _Phase:
    name: str
    epochs: int
    lr: float
    max_samples: int | None


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, list | tuple) and batch:
        return _batch_len(batch[0])
    return 1


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: _to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(v, device, non_blocking) for v in batch)
    return batch


def lr_lambda(warmup: int, total: int, schedule: str, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier at optimizer step ``s``: linear warmup, then constant/linear/cosine."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return min_ratio + (1 - min_ratio) * (1 - progress)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class Trainer:
    """Runs ``step_fn`` over ``train_data`` under whatever launcher started the process.

    ``step_fn(model, batch)`` returns the loss, or a dict with ``"loss"`` and other
    scalar metrics (averaged across ranks in the logs). ``eval_fn(model, batch)``
    returns per-sample means the same way, plus optionally ``"n"``: how many
    samples (or tokens) the means cover, default the batch's leading dimension;
    evaluation sums ``mean * n`` and ``n`` over an unpadded shard per rank, so the
    result equals the single-process value. Without ``eval_fn`` the eval loss is
    ``step_fn`` under ``no_grad``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        train_data: Dataset,
        config: TrainConfig,
        step_fn: StepFn | None = None,
        eval_data: Dataset | None = None,
        eval_fn: StepFn | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.model = model
        self.train_data = train_data
        self.config = config
        self.step_fn = step_fn or _default_step
        self.eval_data = eval_data
        self.eval_fn = eval_fn
        self.collate_fn = collate_fn
        self.global_step = 0
        self.wrapped: torch.nn.Module = model
        self._preempt_signal: int | None = None
        self._signals: SignalWatch | None = None
        self._eval_preempted = False  # evaluate() stopped early on a preemption signal
        self._lock: ckpt.DirLock | None = None  # rank 0: this run owns checkpoint.dir
        self._resume_path = ""
        self._writers: list[Any] = []

    # ---- public -------------------------------------------------------------------
    @property
    def _signals_on(self) -> bool:
        return self._signals is not None and self._signals.installed

    @property
    def preempt_requested(self) -> bool:
        """True once a configured signal arrived on this rank."""
        return self._preempt_signal is not None

    def fit(self) -> dict[str, Any]:
        """Train, evaluate, checkpoint and export; returns a summary dict.

        Joins the job through ``ddp.init()`` when the script did not already.
        """
        cfg = self.config
        ctx = ddp.get_context() or ddp.init(
            backend=cfg.ddp.backend, device=cfg.ddp.device, timeout=cfg.ddp.timeout_s
        )
        self.ctx = ctx
        try:
            self._install_signals()
            return self._fit()
        except SystemExit:
            raise
        except BaseException as exc:
            if ctx.world_size > 1:
                if self._lock is not None:  # _die skips `finally`: free the directory now
                    with contextlib.suppress(Exception):
                        ckpt.wait_pending(timeout=30)
                    self._lock.release()
                _die(ctx.rank, exc)
            raise
        finally:
            with contextlib.suppress(Exception):
                ckpt.wait_pending()  # never leave a checkpoint half-finalized
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            self._restore_signals()
            for w in self._writers:
                with contextlib.suppress(Exception):
                    w.close()
            self._writers = []

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact mean metrics over ``eval_data`` across all ranks (no padded duplicates)."""
        if self.eval_data is None:
            return {}
        ctx = self.ctx
        model = ddp.unwrap(self.wrapped)  # the bare module: no DDP hooks, ranks may differ
        was_training = model.training
        model.eval()
        n = len(self.eval_data)  # type: ignore[arg-type]
        shard = Subset(self.eval_data, range(ctx.rank, n, ctx.world_size))
        loader = DataLoader(
            shard,
            batch_size=self.config.training.batch_size,
            shuffle=False,
            collate_fn=self.collate_fn,
            num_workers=self.config.data.num_workers,
            pin_memory=self.config.data.pin_memory,
        )
        fn = self.eval_fn or self.step_fn
        sums: dict[str, torch.Tensor] = {}
        count = 0.0
        for batch in loader:
            if self._preempt_signal is not None:
                break  # act within a batch, not after the whole pass (SLURM's KillWait: 30 s)
            batch = self._move(batch)
            with self._autocast():
                out = fn(model, batch)
            metrics = out if isinstance(out, dict) else {"loss": out}
            nb = metrics.get("n")
            nb = _batch_len(batch) if nb is None else float(nb)
            for k, v in metrics.items():
                if k == "n":
                    continue
                v = torch.as_tensor(v, device=ctx.device).detach().double()
                sums[k] = sums[k] + v * nb if k in sums else v * nb
            count += nb
        keys = sorted({k for ks in ddp.all_gather_object(sorted(sums)) for k in ks})
        vec = torch.zeros(len(keys) + 2, dtype=torch.float64, device=ctx.device)
        for i, k in enumerate(keys):
            if k in sums:
                vec[i] = sums[k]
        vec[-2] = count
        vec[-1] = float(self._preempt_signal is not None)  # ranks agree in the same reduce
        vec = ddp.reduce_sum(vec).tolist()
        model.train(was_training)
        self._eval_preempted = vec[-1] > 0
        if self._eval_preempted:
            return {}  # partial: the caller saves and exits
        total = vec[-2] or 1.0
        return {f"eval_{k}": vec[i] / total for i, k in enumerate(keys)}

    # ---- setup --------------------------------------------------------------------
    def _install_signals(self) -> None:
        p = self.config.preemption
        self._signals = SignalWatch(p.signals, self._on_signal, self.ctx.rank, p.grace_s)
        self._signals.install()

    def _restore_signals(self) -> None:
        if self._signals is not None:
            self._signals.restore()

    def _on_signal(self, signum: int) -> None:
        self._preempt_signal = signum  # only a flag: the loop acts at the step boundary

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        p = self.config.precision
        if p == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if p == "bf16" else torch.float16
        return torch.autocast(self.ctx.device.type, dtype=dtype)

    def _move(self, batch: Any) -> Any:
        if self.ctx.device.type == "cpu":
            return batch
        return _to_device(batch, self.ctx.device, self.config.data.pin_memory)

    def _phases(self) -> list[_Phase]:
        cfg = self.config
        if not cfg.phases:
            return [_Phase("train", cfg.training.epochs, cfg.optim.lr, cfg.training.max_samples)]
        out = []
        for i, p in enumerate(cfg.phases):
            out.append(
                _Phase(
                    p.name or f"phase{i + 1}",
                    cfg.training.epochs if p.epochs is None else p.epochs,
                    cfg.optim.lr if p.lr is None else p.lr,
                    cfg.training.max_samples if p.max_samples is None else p.max_samples,
                )
            )
        return out

    def _optimizer(self, lr: float) -> torch.optim.Optimizer:
        o = self.config.optim
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        if o.name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)
        return torch.optim.AdamW(
            params, lr=lr, betas=(o.betas[0], o.betas[1]), weight_decay=o.weight_decay
        )

    def _apply_memory_options(self, model: torch.nn.Module) -> None:
        m = self.config.memory
        dev = self.ctx.device
        if m.max_memory_fraction is not None:
            if dev.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(m.max_memory_fraction, dev)
            elif dev.type == "xpu" and hasattr(torch.xpu, "set_per_process_memory_fraction"):
                torch.xpu.set_per_process_memory_fraction(m.max_memory_fraction, dev)
        if m.gradient_checkpointing:
            if hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable()
            elif hasattr(model, "gradient_checkpointing"):
                model.gradient_checkpointing = True
            else:
                raise ConfigError(
                    "memory.gradient_checkpointing: this model has no "
                    "gradient_checkpointing_enable() or gradient_checkpointing attribute"
                )

    def _open_writers(self) -> None:
        cfg = self.config
        if not self.ctx.is_main:
            return
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                logdir = os.path.join(cfg.checkpoint.dir or ".", "tensorboard")
                self._writers.append(_TB(SummaryWriter(logdir)))
            except ImportError:
                log.warning("logging.tensorboard: tensorboard is not installed; skipping")
        if cfg.logging.wandb.project and cfg.logging.wandb.mode != "disabled":
            try:
                import wandb

                run = wandb.init(
                    project=cfg.logging.wandb.project,
                    mode=cfg.logging.wandb.mode,
                    config=cfg.to_dict(),
                )
                self._writers.append(_WB(run))
            except ImportError:
                log.warning("logging.wandb: wandb is not installed; skipping")

    def _emit(self, metrics: dict[str, float], step: int) -> None:
        for w in self._writers:
            w.log(metrics, step)

    # ---- checkpoints --------------------------------------------------------------
    def _resume_state(self) -> dict[str, Any] | None:
        c = self.config.checkpoint
        if c.resume == "none":
            return None
        if c.resume == "auto":
            if not c.dir:
                return None
            path = None
            if self.ctx.is_main:
                found = ckpt.load_latest(c.dir)
                path = str(found[0]) if found else None
            path = ddp.broadcast_object(path)
        else:
            path = c.resume
        if path is None:
            return None
        state = ckpt.load_checkpoint(path)
        log.info("resuming from %s (step %d)", path, state["global_step"])
        self._resume_path = path
        return state

    def _take_lock(self) -> None:
        """Rank 0 locks checkpoint.dir (ckpt.DirLock); every rank stops with its line if not.

        Also the early check that the directory is writable at all: a read-only one is
        reported now, not after the first epoch's work."""
        c = self.config.checkpoint
        if not c.dir:
            return
        error = None
        if self.ctx.is_main:
            try:
                self._lock = ckpt.DirLock.acquire(c.dir)
            except ConfigError as exc:
                error = str(exc)
        error = ddp.broadcast_object(error)
        if error:
            raise ConfigError(error)

    def _save(self, phase: int, epoch: int, batches: int, opt: Any, sched: Any, scaler: Any) -> None:
        """Collective: gather every rank's RNG to rank 0, which writes; then a barrier."""
        c = self.config.checkpoint
        if not c.dir:
            return
        gathered = ddp.all_gather_object((ckpt.rng_state(self.ctx.device), self._finite()))
        if not all(finite for _, finite in gathered):
            self._diverged("the weights are not finite (nan/inf)")
        rngs = [rng for rng, _ in gathered]
        if self.ctx.is_main:
            t0 = time.perf_counter()
            state = {
                "model": ckpt.model_state(self.wrapped),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "phase": phase,
                "epoch": epoch,
                "batches_in_epoch": batches,
                "global_step": self.global_step,
                "phase_start_step": self._phase_start,
                "world_size": self.ctx.world_size,
                "rng": rngs,
                "config": self.config.to_dict(),
            }
            path = ckpt.save_checkpoint(
                state, c.dir, self.global_step, c.keep_last, background=True
            )
            log.info("saved %s in %.2fs (fsync continues in the background)",
                     path, time.perf_counter() - t0)  # fmt: skip
        ddp.barrier()

    def _finite(self) -> bool:
        """Whether this rank's weights are all finite (one host sync: checkpoints only)."""
        params = [p.detach() for p in ddp.unwrap(self.wrapped).parameters()]
        if not params:
            return True
        return bool(torch.stack([torch.isfinite(p).all() for p in params]).all())

    def _diverged(self, what: str) -> None:
        """Stop the run: never save or export non-finite weights, keep the good checkpoints.

        Stopping, not skipping, follows Keras' TerminateOnNaN and Lightning's former
        ``terminate_on_nan``: a NaN rarely heals, and a skipped step hides the cause.
        """
        raise TrainingDiverged(
            f"step {self.global_step}: {what}: training diverged; nothing was saved from these "
            "weights and the earlier checkpoints are kept. Lower optim.lr, set "
            "optim.grad_clip, or check the data"
        )

    # ---- the loop -----------------------------------------------------------------
    def _fit(self) -> dict[str, Any]:
        ctx, cfg = self.ctx, self.config
        t_cfg = cfg.training
        seed = t_cfg.seed
        random.seed(seed + ctx.rank)
        torch.manual_seed(seed + ctx.rank)  # per-rank streams (dropout, masks); DDP syncs weights

        model = self.model.to(ctx.device)
        self._apply_memory_options(model)
        d = cfg.ddp
        self.wrapped = ddp.wrap(
            model,
            find_unused_parameters=d.find_unused_parameters,
            gradient_as_bucket_view=d.gradient_as_bucket_view,
            static_graph=d.static_graph,
            bucket_cap_mb=d.bucket_cap_mb,
        )
        world = ctx.world_size
        factor = cfg.scale_factor(world)
        warmup = cfg.scaled_warmup(world)
        log.info(
            "world=%d effective batch=%d (%d x accum %d x %d ranks) lr=%.4g (x%.4g, %s rule) "
            "warmup=%d precision=%s",
            world, cfg.effective_batch(world), t_cfg.batch_size, t_cfg.accum, world,
            cfg.scaled_lr(world), factor, cfg.scaling.rule, warmup, cfg.precision,
        )  # fmt: skip
        self._open_writers()
        self._take_lock()
        state = self._resume_state()
        if state is not None:
            _check_resumable(state.get("config") or {}, cfg.to_dict(), self._resume_path)
            self.global_step = state["global_step"]
            rngs = state.get("rng") or []
            if state.get("world_size") == world and len(rngs) == world:
                ckpt.set_rng_state(rngs[ctx.rank], ctx.device)
            else:
                log.warning("checkpoint from world size %s: RNG states not restored",
                            state.get("world_size"))  # fmt: skip
            _load_model(ddp.unwrap(self.wrapped), state["model"], self._resume_path)

        summary: dict[str, Any] = {"steps": 0, "train_loss": float("nan")}
        self._t_start = time.perf_counter()
        self._samples = 0
        self._stop = False
        eval_metrics: dict[str, float] = {}
        evaluated_last = False
        max_steps = cfg.training.max_steps
        if max_steps is not None and self.global_step >= max_steps:
            # A finished run started again (resume: auto) trains nothing more.
            log.info("max_steps=%d already reached at step %d", max_steps, self.global_step)
            self._stop = True
        for pi, phase in enumerate(self._phases()):
            if self._stop:
                break
            if pi < (state["phase"] if state else 0):
                continue
            if cfg.phases and cfg.phases[pi].skip:
                log.info("phase %s skipped", phase.name)
                continue
            resume = state if state is not None and state["phase"] == pi else None
            loss, evaluated_last, eval_metrics = self._run_phase(
                pi, phase, factor, warmup, resume, eval_metrics
            )
            state = None
            if not math.isnan(loss):
                summary["train_loss"] = loss
            if self._stop:
                break
        if self.eval_data is not None and not evaluated_last:
            eval_metrics = self.evaluate()
            if self._eval_preempted:  # training is over and saved; resume evaluates
                self._exit_preempted()
            self._emit(eval_metrics, self.global_step)
        elapsed = time.perf_counter() - self._t_start
        samples = ddp.reduce_sum(torch.tensor([float(self._samples)])).item()
        summary.update(eval_metrics)
        summary.update(
            steps=self.global_step,
            samples=int(samples),
            samples_per_s=samples / elapsed if elapsed > 0 else 0.0,
            elapsed_s=elapsed,
            peak_memory_mb=_peak_memory_mb(ctx.device),
        )
        c = cfg.checkpoint
        ckpt.wait_pending()
        if c.dir and c.save_final:
            if not all(ddp.all_gather_object(self._finite())):
                self._diverged("the weights are not finite (nan/inf)")
            if ctx.is_main:
                path = ckpt.export_final(self.wrapped, c.dir, cfg.to_yaml())
                summary["final_model"] = str(path)
            ddp.barrier()
        log.info("done: %s", ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
        return summary

    def _run_phase(
        self,
        pi: int,
        phase: _Phase,
        factor: float,
        warmup: int,
        resume: dict[str, Any] | None,
        eval_metrics: dict[str, float],
    ) -> tuple[float, bool, dict[str, float]]:
        ctx, cfg = self.ctx, self.config
        t_cfg = cfg.training
        data = self.train_data
        if phase.max_samples is not None and phase.max_samples < len(data):  # type: ignore[arg-type]
            data = Subset(data, range(phase.max_samples))
        sampler = _ResumableSampler(
            data,
            num_replicas=ctx.world_size,
            rank=ctx.rank,
            shuffle=t_cfg.shuffle,
            seed=t_cfg.seed,
            drop_last=t_cfg.drop_last,
        )
        gen = torch.Generator().manual_seed(t_cfg.seed)  # keeps the global RNG untouched
        loader = DataLoader(
            data,
            batch_size=t_cfg.batch_size,
            sampler=sampler,
            num_workers=cfg.data.num_workers,
            pin_memory=cfg.data.pin_memory,
            collate_fn=self.collate_fn,
            persistent_workers=cfg.data.num_workers > 0,
            generator=gen,
        )
        n_batches = math.ceil(sampler.num_samples / t_cfg.batch_size)
        steps_per_epoch = math.ceil(n_batches / t_cfg.accum)
        total = steps_per_epoch * phase.epochs
        # Steps done before this phase began (from the checkpoint on resume), so the
        # schedule horizon is the same in a resumed run as in an uninterrupted one.
        self._phase_start = resume.get("phase_start_step", 0) if resume else self.global_step
        if t_cfg.max_steps is not None:
            total = min(total, max(0, t_cfg.max_steps - self._phase_start))
        opt = self._optimizer(phase.lr * factor)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(warmup, total, cfg.optim.schedule, cfg.optim.min_lr_ratio)
        )
        scaler = (
            torch.amp.GradScaler(ctx.device.type) if cfg.precision == "fp16" else None
        )
        start_epoch, start_batch = 0, 0
        if resume is not None:
            opt.load_state_dict(resume["optimizer"])
            sched.load_state_dict(resume["scheduler"])
            _apply_new_hyperparameters(opt, sched, phase.lr * factor, cfg)
            if scaler is not None and resume.get("scaler"):
                scaler.load_state_dict(resume["scaler"])
            start_epoch, start_batch = resume["epoch"], resume["batches_in_epoch"]
        bar = _Progress(ctx.is_main, cfg.logging.progress, total, phase.name)
        bar.advance_to(self.global_step - self._phase_start)
        last_loss = float("nan")
        evaluated = False
        try:
            for epoch in range(start_epoch, phase.epochs):
                sampler.set_epoch(epoch)
                sampler.start = start_batch * t_cfg.batch_size
                loss = self._train_epoch(
                    pi, epoch, loader, n_batches, start_batch, opt, sched, scaler, bar
                )
                start_batch = 0
                if not math.isnan(loss):
                    last_loss = loss
                if self._stop:
                    break
                every = t_cfg.eval_every_n_epochs
                evaluated = False
                if self.eval_data is not None and every and (epoch + 1) % every == 0:
                    eval_metrics = self.evaluate()
                    if self._eval_preempted:  # resume re-runs this evaluation, then goes on
                        self._save(pi, epoch, n_batches, opt, sched, scaler)
                        self._exit_preempted()
                    evaluated = True
                    self._emit(eval_metrics, self.global_step)
                    log.info("epoch %d %s", epoch + 1,
                             " ".join(f"{k}={v:.4f}" for k, v in eval_metrics.items()))  # fmt: skip
                self._save(pi, epoch + 1, 0, opt, sched, scaler)
        finally:
            bar.close()
        return last_loss, evaluated, eval_metrics

    def _train_epoch(
        self,
        pi: int,
        epoch: int,
        loader: DataLoader,
        n_batches: int,
        start_batch: int,
        opt: torch.optim.Optimizer,
        sched: Any,
        scaler: Any,
        bar: _Progress,
    ) -> float:
        """One (possibly partial) epoch; returns the rank-averaged mean train loss."""
        ctx, cfg = self.ctx, self.config
        model = self.wrapped
        accum = cfg.training.accum
        bs = cfg.training.batch_size
        clip = cfg.optim.grad_clip
        log_every = cfg.logging.every_n_steps
        ckpt_every = cfg.checkpoint.every_n_steps if cfg.checkpoint.dir else 0
        max_steps = cfg.training.max_steps
        check_every = cfg.preemption.check_every_n_steps if self._signals_on else 0
        distributed = ctx.world_size > 1
        step_fn = self.step_fn
        autocast = self._autocast()
        params = [p for g in opt.param_groups for p in g["params"]]
        n_samples_rank = loader.sampler.num_samples  # type: ignore[attr-defined]

        dev = ctx.device
        loss_sum = torch.zeros((), device=dev)  # in-place accumulators: no per-step allocs
        epoch_sum = torch.zeros((), device=dev)
        extra: dict[str, torch.Tensor] = {}
        flags = (torch.zeros(1, device=dev), torch.zeros(1, device=dev))
        cur = 0
        pending: Any = None  # in-flight preemption all_reduce
        window_micro = 0
        epoch_micro = 0
        t_window = time.perf_counter()
        step_window = self.global_step
        b = start_batch  # absolute micro-batch index inside the epoch
        group_start = b - (b % accum)

        for batch in loader:
            batch = self._move(batch)
            last_in_group = (b + 1 - group_start) == accum or b + 1 == n_batches
            group = min(accum, n_batches - group_start)
            sync = contextlib.nullcontext() if last_in_group or not distributed else model.no_sync()
            with sync:
                with autocast:
                    out = step_fn(model, batch)
                if isinstance(out, dict):
                    loss = out["loss"]
                    for k, v in out.items():
                        if k != "loss" and isinstance(v, torch.Tensor):
                            if k in extra:
                                extra[k].add_(v.detach())
                            else:
                                extra[k] = v.detach().float().clone()
                else:
                    loss = out
                scaled = loss / group if group != 1 else loss
                if scaler is not None:
                    scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            loss_sum.add_(loss.detach())
            window_micro += 1
            epoch_micro += 1
            b += 1
            if not last_in_group:
                continue
            group_start = b

            if clip:
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            self.global_step += 1
            step = self.global_step

            if step % log_every == 0 or b == n_batches:
                epoch_sum.add_(loss_sum)
                self._log_window(
                    loss_sum, extra, window_micro, step, step_window, t_window, opt, epoch, bar
                )
                loss_sum.zero_()
                for v in extra.values():
                    v.zero_()
                window_micro = 0
                t_window = time.perf_counter()
                step_window = step
            if check_every and step % check_every == 0:
                # Ranks agree through an async MAX all_reduce issued here and read at the
                # next check: it overlaps a step of compute instead of stalling this one,
                # and every rank acts on the same (previous) result, so all stop together.
                if pending is not None:
                    pending.wait()
                    if flags[cur].item():
                        self._preempt(pi, epoch, b, opt, sched, scaler, n_batches)
                cur ^= 1
                flags[cur].fill_(1.0 if self._preempt_signal is not None else 0.0)
                if distributed:
                    pending = torch.distributed.all_reduce(
                        flags[cur], op=torch.distributed.ReduceOp.MAX, async_op=True
                    )
                elif flags[cur].item():
                    self._preempt(pi, epoch, b, opt, sched, scaler, n_batches)
            if max_steps is not None and step >= max_steps:
                log.info("max_steps=%d reached", max_steps)
                self._stop = True
                pending = self._settle(pending, flags[cur], pi, epoch, b, opt, sched, scaler,
                                       n_batches)  # fmt: skip
                self._save_at(pi, epoch, b, n_batches, opt, sched, scaler)
                break
            if ckpt_every and step % ckpt_every == 0 and b < n_batches:
                self._save(pi, epoch, b, opt, sched, scaler)

        self._settle(pending, flags[cur], pi, epoch, b, opt, sched, scaler, n_batches)
        if window_micro:  # stopped between log points
            epoch_sum.add_(loss_sum)
        self._samples += min(b * bs, n_samples_rank) - min(start_batch * bs, n_samples_rank)
        mean = ddp.reduce_sum(torch.stack([epoch_sum.float(), torch.tensor(
            float(epoch_micro), device=dev)])).tolist()  # fmt: skip
        return mean[0] / mean[1] if mean[1] else float("nan")

    def _settle(self, pending, flag, pi, epoch, b, opt, sched, scaler, n_batches) -> None:  # noqa: ANN001
        """Finish an in-flight preemption check (before saving or leaving the epoch)."""
        if pending is not None:
            pending.wait()
            if flag.item():
                self._preempt(pi, epoch, b, opt, sched, scaler, n_batches)
        return None

    def _save_at(self, pi, epoch, b, n_batches, opt, sched, scaler) -> None:  # noqa: ANN001
        if b >= n_batches:
            self._save(pi, epoch + 1, 0, opt, sched, scaler)
        else:
            self._save(pi, epoch, b, opt, sched, scaler)

    def _preempt(self, pi, epoch, b, opt, sched, scaler, n_batches) -> None:  # noqa: ANN001
        log.warning("preemption signal: saving at step %d and exiting %d",
                    self.global_step, PREEMPTED_EXIT_CODE)  # fmt: skip
        self._save_at(pi, epoch, b, n_batches, opt, sched, scaler)
        self._exit_preempted()

    def _exit_preempted(self) -> None:
        """After the preemption checkpoint: wait for it, requeue (SLURM), exit 75."""
        if self._eval_preempted:
            log.warning("preemption signal during evaluation: saved at step %d, exiting %d",
                        self.global_step, PREEMPTED_EXIT_CODE)  # fmt: skip
        ckpt.wait_pending()
        ddp.barrier()  # the checkpoint is durable everywhere before anyone exits
        job = os.environ.get("SLURM_JOB_ID")
        requeue = self.config.preemption.requeue or os.environ.get("DDP_REQUEUE") == "1"
        if requeue and job and self.ctx.is_main:
            try:
                subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
                log.warning("requeued SLURM job %s", job)
            except (OSError, subprocess.SubprocessError) as exc:
                log.error("scontrol requeue %s failed: %s", job, exc)
        ddp.shutdown()
        raise Preempted()

    def _log_window(self, loss_sum, extra, micro, step, step0, t0, opt, epoch, bar) -> None:  # noqa: ANN001
        """One collective for every logged metric, then rank 0 reports."""
        names = ["loss", *sorted(extra)]
        vec = torch.stack([loss_sum.float(), *(extra[k].float() for k in names[1:])])
        vec = ddp.reduce_mean(vec / max(1, micro)).tolist()
        if not math.isfinite(vec[0]) and self.config.precision != "fp16":
            # fp16's GradScaler skips overflowing steps by design; its weights are checked
            # before every save instead.
            self._diverged(f"the mean loss since step {step0} is {vec[0]}")
        dt = time.perf_counter() - t0
        metrics = dict(zip(names, vec, strict=True))
        world = self.ctx.world_size
        metrics["samples_per_s"] = micro * self.config.training.batch_size * world / dt if dt else 0
        metrics["step_time_s"] = dt / max(1, step - step0)
        metrics["lr"] = opt.param_groups[0]["lr"]
        self.last_metrics = metrics
        if not self.ctx.is_main:
            return
        bar.update(step - self._phase_start, metrics)
        if bar.plain:
            log.info(
                "step %d epoch %d %s", step, epoch + 1,
                " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()),
            )  # fmt: skip
        self._emit({f"train/{k}": v for k, v in metrics.items()}, step)


# ---- helpers ---------------------------------------------------------------------------
def _die(rank: int, exc: BaseException) -> None:
    """Report a failure naming the rank and end this process now (see module docstring).

    A checkpoint still being finished in the background is completed first (bounded),
    so a failure right after a save does not lose that save.
    """
    with contextlib.suppress(Exception):
        ckpt.wait_pending(timeout=30)
    if isinstance(exc, ConfigError):
        msg = f"ddp: error: rank {rank} failed: {exc}\n"
        code = 2
    else:
        tb = "".join(traceback.format_exception(exc))
        msg = f"{tb}rank {rank} failed: {type(exc).__name__}: {exc}\n"
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.write(msg)
        sys.stderr.flush()
    finally:
        os._exit(code)


# Keys whose change makes the saved data position or optimizer state meaningless.
_FIXED_ON_RESUME = ("optim.name", "training.batch_size", "training.accum", "training.seed",
                    "training.shuffle", "training.drop_last")  # fmt: skip


def _check_resumable(old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    """Stop on a change the checkpoint cannot carry; log every other changed key.

    A resumed run either applies a new value (optimizer hyper-parameters, the schedule,
    more epochs: :func:`_apply_new_hyperparameters`) and says so, or stops with one
    line; it never mixes old and new silently.
    """

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    before, after = flat(old), flat(new)
    changed = [k for k in after if k in before and before[k] != after[k]]
    for key in changed:
        if key in _FIXED_ON_RESUME:
            raise ConfigError(
                f"{key}: {after[key]!r} differs from {before[key]!r} in the checkpoint "
                f"{path!r}, which cannot continue with it; allowed: the checkpoint's value, "
                "or a fresh checkpoint.dir / checkpoint.resume=none"
            )
    for key in changed:
        if key != "checkpoint.resume":
            log.warning("resume: %s changed %r -> %r; the new value applies", key,
                        before[key], after[key])  # fmt: skip


def _apply_new_hyperparameters(opt: Any, sched: Any, base_lr: float, cfg: TrainConfig) -> None:
    """Make the config's optimizer values win over the ones restored from the checkpoint.

    ``opt.load_state_dict`` brings back the saved lr, weight decay and betas, and the
    scheduler its saved base LR; without this a new ``optim.lr`` would be printed at
    start-up and then ignored. Unchanged values are left untouched (bit-exact resume).
    """
    o = cfg.optim
    want: dict[str, Any] = {"weight_decay": o.weight_decay}
    if o.name == "sgd":
        want["momentum"] = o.momentum
    else:
        want["betas"] = (o.betas[0], o.betas[1])
    for group in opt.param_groups:
        for key, value in want.items():
            if key in group and group[key] != value:
                group[key] = value
    if any(b != base_lr for b in sched.base_lrs):
        sched.base_lrs = [base_lr for _ in sched.base_lrs]
        factor = sched.lr_lambdas[0](sched.last_epoch)
        for group in opt.param_groups:
            group["initial_lr"] = base_lr
            group["lr"] = base_lr * factor
        sched._last_lr = [g["lr"] for g in opt.param_groups]


def _load_model(model: torch.nn.Module, saved: dict[str, Any], path: str) -> None:
    """``load_state_dict`` with one line naming the first mismatch, not torch's 40."""
    own = model.state_dict()
    missing = sorted(set(own) - set(saved))
    extra = sorted(set(saved) - set(own))
    shapes = [k for k in own if k in saved and tuple(own[k].shape) != tuple(saved[k].shape)]
    if missing or extra or shapes:
        if shapes:
            k = shapes[0]
            what = (f"{k!r} is {tuple(saved[k].shape)} in the checkpoint and "
                    f"{tuple(own[k].shape)} in this model")  # fmt: skip
        else:
            what = f"keys missing {missing[:3]}, unexpected {extra[:3]}"
        raise ConfigError(
            f"checkpoint {path!r} was saved from a different model ({what}); allowed: the "
            "same model settings, or a fresh checkpoint.dir / checkpoint.resume=none"
        )
    model.load_state_dict(saved)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if device.type == "xpu" and hasattr(torch.xpu, "max_memory_allocated"):
        return torch.xpu.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    except ImportError:  # pragma: no cover
        return float("nan")


class _TB:
    def __init__(self, writer: Any) -> None:
        self.w = writer

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class _WB:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Progress:
    """Rank-0 progress: a rich bar on a TTY, plain log lines otherwise."""

    def __init__(self, main: bool, mode: str, total: int, name: str) -> None:
        self.bar = None
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "plain"
        self.plain = main and mode == "plain"
        if main and mode == "bar":
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[sps]} samples/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self.bar.start()
            self.task = self.bar.add_task(name, total=total, loss="-", sps="-")

    def advance_to(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.update(
                self.task,
                completed=step,
                loss=f"{metrics['loss']:.4f}",
                sps=f"{metrics['samples_per_s']:.0f}",
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
