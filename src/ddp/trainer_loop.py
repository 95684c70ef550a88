"""The Trainer's loop: what one ``fit()`` holds (:class:`Run`), one epoch's hot loop and
the exact evaluation (:class:`EpochLoop`, a part of :class:`ddp.trainer.Trainer`).

Split from :mod:`ddp.trainer` so each reads alone: the trainer sets up the model, the
phases and the checkpoints; this module is what runs every step. Nothing here reads the
device between log points (see :mod:`ddp.trainer`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

import ddp
from ddp import fsdp, parts, stragglers
from ddp.checkpoint.manager import Checkpointer, LoopState, TrainState, diverged
from ddp.config import TrainConfig
from ddp.dist import Context, agreement
from ddp.heartbeat import Heartbeat, heartbeat_dir
from ddp.loggers import Loggers, layer_sq_norms
from ddp.preemption import Preemption
from ddp.stragglers import Stragglers

log = logging.getLogger("ddp")

StepFn = Callable[[torch.nn.Module, Any], Any]


def length(data: Dataset) -> int:
    """``len(data)``: the trainer shards map-style datasets by index, so they have one."""
    if not isinstance(data, Sized):
        raise TypeError(f"the Trainer needs a dataset with a length, got {type(data).__name__}")
    return len(data)


class Run:
    """What one ``fit()`` holds, built whole once the process group exists: the context,
    the checkpointer, the loggers, the heartbeat and the preemption (signals, vote,
    requeue). The counters are the Trainer's :class:`~ddp.checkpoint.loop.TrainState`.

    Why not built in ``Trainer.__init__``: a script may construct the Trainer before
    any process group exists (``fit()`` then joins the job through ``ddp.init()``), and
    the checkpointer, the loggers (W&B, TensorBoard) and the vote all need the ranks.
    So the Trainer holds one ``Run`` instead of half-built ``None`` collaborators.
    """

    def __init__(
        self, config: TrainConfig, ctx: Context, clock: Callable[[], float], step: int
    ) -> None:
        self.ctx = ctx
        self.checkpointer = Checkpointer(config, ctx)
        self.beat = Heartbeat(heartbeat_dir(), ctx.rank, node_rank=ctx.node_rank)
        self.beat.beat(step, "start", force=True)  # before the loggers (W&B may take long)
        self.loggers = Loggers(config, ctx.is_main, ctx.world_size)
        every_s = config.checkpoint.every_s if config.checkpoint.dir else 0.0
        self.preemption = Preemption(
            config.preemption, ctx.rank, ctx.world_size, every_s, agreement(), clock
        )


class EpochLoop:
    """The hot loop and evaluation of :class:`ddp.trainer.Trainer` (its base class)."""

    # What the Trainer provides (set in its __init__ and fit()).
    config: TrainConfig
    wrapped: torch.nn.Module
    train_state: TrainState
    step_fn: StepFn
    eval_fn: StepFn | None
    eval_data: Dataset | None
    collate_fn: Callable[[list[Any]], Any] | None
    after_step: Callable[[Any, int], None] | None
    finish_eval: Callable[[dict[str, float]], dict[str, float]] | None
    last_metrics: dict[str, float]
    _norms: dict[str, Any]
    _stragglers: Stragglers | None
    _device_times: stragglers.DeviceTimes | None
    _mark: Callable[[], None]

    _run: Run | None = None  # the current (or last) fit()'s

    @property
    def _r(self) -> Run:
        if self._run is None:
            raise RuntimeError(
                "the Trainer's context, checkpointer and loggers exist once fit() has started"
            )
        return self._run

    @property
    def global_step(self) -> int:
        """Optimizer steps taken over the whole run (resumed runs included): the
        :class:`~ddp.checkpoint.loop.TrainState`'s."""
        return self.train_state.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.train_state.global_step = value

    @property
    def ctx(self) -> Context:
        """This rank's place in the job (from ``fit()`` on)."""
        return self._r.ctx

    @property
    def loggers(self) -> Loggers:
        """Console, metrics.jsonl, TensorBoard and W&B (from ``fit()`` on)."""
        return self._r.loggers

    # The Trainer's, beside its checkpoints: save, and act on an agreed preemption.
    def _preempt(self, loop: LoopState) -> None:
        raise NotImplementedError

    def _settle_vote(self, loop: LoopState) -> None:
        raise NotImplementedError

    def _save(self, loop: LoopState, at: tuple[int, int]) -> None:
        raise NotImplementedError

    # ---- one epoch: the hot loop ----------------------------------------------------------
    def _train_epoch(
        self, loader: DataLoader, sampler: parts.GlobalOrderSampler, loop: LoopState
    ) -> float:
        """One (possibly partial) epoch; returns the rank-averaged mean train loss.

        The loop body is one micro-batch, then at each accumulation boundary the
        optimizer step, the log point, the vote and the checkpoints, in that order."""
        run = self._r
        cfg, dev = self.config, run.ctx.device
        accum, n = cfg.training.accum, loop.n_batches
        max_steps = cfg.training.max_steps
        ckpt_every = cfg.checkpoint.every_n_steps if cfg.checkpoint.dir else 0
        win = parts.LossWindow(
            torch.zeros((), device=dev), torch.zeros((), device=dev), step0=self.global_step
        )
        first = loop.batch
        group_start = first - first % accum
        t_wait = time.perf_counter()  # data wait: from the end of one batch to the next
        for batch in loader:
            win.times[0] += time.perf_counter() - t_wait
            last_in_group = loop.batch + 1 - group_start == accum or loop.batch + 1 == n
            self._micro_step(batch, win, min(accum, n - group_start), last_in_group, loop)
            loop.batch += 1
            if not last_in_group:
                t_wait = time.perf_counter()
                continue
            group_start = loop.batch
            logs = (self.global_step + 1) % cfg.logging.every_n_steps == 0 or loop.batch == n
            t_opt = time.perf_counter()
            step = self._optimizer_step(loop, norms=logs)
            win.times[2] += time.perf_counter() - t_opt
            run.beat.beat(step)  # a host int and a clock read: no device sync
            if logs:
                self._log_point(win, loop, step)
            if self.after_step is not None:
                self.after_step(self, step)
            if run.preemption.step(step):
                self._preempt(loop)
            if max_steps is not None and step >= max_steps:
                log.info("max_steps=%d reached", max_steps)
                self.train_state.finished = True
                self._settle_vote(loop)
                self._save(loop, at=loop.after_batches())
                break
            timed = run.preemption.take_save()  # checkpoint.every_s
            if (timed or ckpt_every and step % ckpt_every == 0) and loop.batch < n:
                self._save(loop, at=(loop.epoch, loop.batch))
            t_wait = time.perf_counter()
        self._settle_vote(loop)
        if win.micro:  # stopped between log points
            win.epoch_loss.add_(win.loss)
        bs, per_rank = cfg.training.batch_size, sampler.num_samples
        self.train_state.samples += min(loop.batch * bs, per_rank) - min(first * bs, per_rank)
        mean = ddp.reduce_sum(
            torch.stack([win.epoch_loss.float(), torch.tensor(float(win.epoch_micro), device=dev)])
        ).tolist()
        return mean[0] / mean[1] if mean[1] else float("nan")

    def _micro_step(
        self, batch: Any, win: parts.LossWindow, group: int, last_in_group: bool, loop: LoopState
    ) -> None:
        """Forward and backward of one micro-batch; gradients sync only on the last one."""
        model = self.wrapped
        batch = self._move(batch)
        t0 = time.perf_counter()
        self._mark()
        with parts.grad_sync(model, last_in_group):
            with parts.autocast(self.config.precision, self.ctx.device):
                loss = win.add(self.step_fn(model, batch))
            t1 = time.perf_counter()
            self._mark()
            scaled = loss / group if group != 1 else loss
            if loop.scaler is not None:
                loop.scaler.scale(scaled).backward()
            else:
                scaled.backward()
        self._mark()
        win.times[1] += t1 - t0  # the forward: what DDP does not equalise across ranks
        win.times[2] += time.perf_counter() - t1

    def _optimizer_step(self, loop: LoopState, norms: bool = False) -> int:
        """Clip, step, schedule, zero; returns the new global step. ``norms``: the step
        ends at a log point, so take the per-layer norms monitoring asks for (on the
        device, read with the log point's numbers)."""
        opt, scaler, clip = loop.opt, loop.scaler, self.config.optim.grad_clip
        mon = self.config.monitoring
        if clip:
            if scaler is not None:
                scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip)
        if norms and mon.log_gradients:  # after clipping: the gradients the step applies
            if scaler is not None and not clip:
                scaler.unscale_(opt)
            self._norms["grad_norm"] = layer_sq_norms(self.wrapped, grads=True)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        loop.sched.step()
        if norms and mon.log_weights:
            self._norms["weight_norm"] = layer_sq_norms(self.wrapped, grads=False)
        opt.zero_grad(set_to_none=True)
        self.global_step += 1
        return self.global_step

    def _log_point(self, win: parts.LossWindow, loop: LoopState, step: int) -> None:
        """One collective for every logged metric, then rank 0 reports."""
        names = ["loss", *sorted(win.extra)]
        dt = time.perf_counter() - win.t0
        packed = torch.stack([win.loss.float(), *(win.extra[k].float() for k in names[1:])])
        packed = torch.cat([packed / max(1, win.micro), packed.new_tensor([dt])])
        layers = [(kind, names) for kind, (names, sq) in self._norms.items() if names]
        if layers:  # per-layer squared norms ride on the same collective and read
            packed = torch.cat([packed, *(self._norms[k][1].float() for k, _ in layers)])
        world, n_steps = self.ctx.world_size, max(1, step - win.step0)
        strag = self._stragglers
        n_slots = world * len(stragglers.PHASES) if strag is not None else 0
        if n_slots:  # every rank's phase times, in its own slots of the same collective
            times = (
                self._device_times.phases(win.times)
                if self._device_times is not None
                else win.times
            )  # device events are read here only
            mine = stragglers.slots(world, self.ctx.rank, [t / n_steps for t in times])
            packed = torch.cat([packed, packed.new_tensor(mine)])
        vec = ddp.reduce_mean(packed).tolist()
        per_rank_metrics: dict[str, float] = {}
        if n_slots:
            summed, vec = [v * world for v in vec[len(vec) - n_slots :]], vec[: len(vec) - n_slots]
            if strag is not None and self.ctx.is_main:
                per_rank_metrics = strag.update(step, stragglers.unpack(summed, world))
        n_layer = sum(len(names) for _, names in layers)
        norms, vec = vec[len(vec) - n_layer :], vec[: len(vec) - n_layer]
        *vec, mean_dt = vec  # the wall time too: the same on all ranks
        if not math.isfinite(vec[0]) and self.config.precision != "fp16":
            # fp16's GradScaler skips overflowing steps by design; its weights are checked
            # before every save instead.
            raise diverged(step, f"the mean loss since step {win.step0} is {vec[0]}")
        self._r.preemption.pace(mean_dt / max(1, step - win.step0))
        metrics = dict(zip(names, vec, strict=True))
        samples = win.micro * self.config.training.batch_size * self.ctx.world_size
        metrics["samples_per_s"] = samples / dt if dt else 0
        metrics["step_time_s"] = dt / max(1, step - win.step0)
        metrics["lr"] = loop.opt.param_groups[0]["lr"]
        metrics["memory_mb"] = parts.peak_memory_mb(self.ctx.device)  # allocator stats: no sync
        shards = self.ctx.world_size if fsdp.is_sharded(ddp.unwrap(self.wrapped)) else 1
        for kind, names in layers:  # DDP: equal on every rank; FSDP: local shards, summed
            for name in names:
                metrics[f"{kind}/{name}"] = math.sqrt(max(0.0, norms.pop(0) * shards))
        self._norms.clear()
        metrics.update(per_rank_metrics)
        self.last_metrics = metrics
        self.loggers.train(metrics, step, step - loop.phase_start, loop.epoch)
        win.reset(step)

    def _move(self, batch: Any) -> Any:
        """The batch on this rank's device. On CUDA the copy is always ``non_blocking``: a
        blocking copy makes the host wait for all queued GPU work every step (a stream
        synchronisation), while an async copy from pageable memory is staged by the driver
        before it returns, so it is safe unpinned too (``pin_memory`` makes it truly
        asynchronous)."""
        dev = self.ctx.device
        if dev.type == "cpu":
            return batch
        return parts.to_device(batch, dev, self.config.data.pin_memory or dev.type == "cuda")

    # ---- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact mean metrics over ``eval_data`` across all ranks (no padded duplicates)."""
        if self.eval_data is None:
            return {}
        ctx, data = self.ctx, self.eval_data
        model = ddp.unwrap(self.wrapped)  # the bare module: no DDP hooks, ranks may differ
        was_training = model.training
        model.eval()
        shard = Subset(data, range(ctx.rank, length(data), ctx.world_size))
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
        pad, lockstep = Subset(data, [0]), fsdp.is_sharded(model)
        preemption = self._r.preemption
        self._r.beat.beat(self.global_step, "eval", force=True)
        for batch, weight in parts.eval_batches(
            loader, lockstep, lambda: preemption.requested, pad
        ):
            batch = self._move(batch)
            with parts.autocast(self.config.precision, ctx.device):
                out = fn(model, batch)
            metrics = out if isinstance(out, dict) else {"loss": out}
            nb = metrics.get("n")
            nb = (parts.batch_len(batch) if nb is None else float(nb)) * weight
            for k, v in metrics.items():
                if k != "n":
                    v = torch.as_tensor(v, device=ctx.device).detach().double()
                    sums[k] = sums[k] + v * nb if k in sums else v * nb
            count += nb
        keys = sorted({k for ks in ddp.all_gather_object(sorted(sums)) for k in ks})
        packed = torch.zeros(len(keys) + 2, dtype=torch.float64, device=ctx.device)
        for i, k in enumerate(keys):
            if k in sums:
                packed[i] = sums[k]
        packed[-2] = count
        packed[-1] = float(preemption.requested)  # ranks agree in the same reduce
        vec = ddp.reduce_sum(packed).tolist()
        model.train(was_training)
        preemption.in_eval = vec[-1] > 0
        if preemption.in_eval:
            return {}  # partial: the caller saves and exits
        total = vec[-2] or 1.0
        out = {f"eval_{k}": vec[i] / total for i, k in enumerate(keys)}
        return self.finish_eval(out) if self.finish_eval is not None else out
