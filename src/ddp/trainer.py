"""Trainer: the DDP training loop written once (sampler epochs, accumulation, AMP,
clipping, warmup + schedule, exact evaluation, checkpoints, preemption, failure).

The loop reads top to bottom like nanoGPT's; its named parts live elsewhere: the
:class:`~ddp.checkpoint.manager.Checkpointer` owns every checkpoint, :mod:`ddp.preemption`
the signals, the ranks' vote and the requeue, :mod:`ddp.loggers` the console,
TensorBoard and W&B, :mod:`ddp.parts` the small building blocks.

The hot loop has no host-device synchronisation between log points: losses
accumulate in place into preallocated device tensors, the preemption vote travels as
a CPU tensor over a tree of small Gloo groups (:class:`~ddp.preemption.Vote`,
:mod:`ddp.agree`), and nothing is read
back from the device except every ``logging.every_n_steps`` and at checkpoints. (fp16
is the exception torch imposes: GradScaler reads its overflow flag every step.)

Exit codes: a preempted run saves one checkpoint and exits 75 (``Preempted``); a rank
that fails prints ``rank N failed: ...`` and ends at once (:func:`ddp.parts.die`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

import ddp
from ddp import parts, stragglers
from ddp.checkpoint.manager import Checkpointer, LoopState, TrainState
from ddp.config import TrainConfig, log_config_notes
from ddp.heartbeat import Heartbeat
from ddp.loggers import fmt
from ddp.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption, Vote
from ddp.stragglers import Stragglers
from ddp.trainer_loop import EpochLoop, Run, StepFn, length

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "Trainer"]

log = logging.getLogger("ddp")


def _default_step(model: torch.nn.Module, batch: Any) -> Any:
    return model(batch)


class Trainer(EpochLoop):
    """Runs ``step_fn`` over ``train_data`` under whatever launcher started the process.

    ``step_fn(model, batch)`` returns the loss, or a dict with ``"loss"`` and other
    scalar metrics (averaged across ranks in the logs). ``eval_fn(model, batch)``
    returns per-sample means the same way, plus optionally ``"n"``: how many
    samples (or tokens) the means cover, default the batch's leading dimension;
    evaluation sums ``mean * n`` and ``n`` over an unpadded shard per rank, so the
    result equals the single-process value. Without ``eval_fn`` the eval loss is
    ``step_fn`` under ``no_grad``.

    Its collaborators (context, checkpointer, loggers, heartbeat, preemption) are one
    :class:`~ddp.trainer_loop.Run` that ``fit()`` builds whole: the process group may
    not exist at construction (``fit()`` then calls ``ddp.init``), and every one of them
    needs the ranks. So nothing is a half-built ``None``; ``ctx``, ``checkpointer`` and
    ``loggers`` read the run's (an error before ``fit()``). The hot loop and evaluation
    are :class:`~ddp.trainer_loop.EpochLoop`; this class sets up the model, the phases
    and the checkpoints.
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
        after_step: Callable[[Trainer, int], None] | None = None,
        finish_eval: Callable[[dict[str, float]], dict[str, float]] | None = None,
    ) -> None:
        self.model = model
        self.train_data = train_data
        self.config = config
        self.step_fn = step_fn or _default_step
        self.eval_data = eval_data
        self.eval_fn = eval_fn
        self.collate_fn = collate_fn
        #: the run's counters (global step, samples, finished), one state object the
        #: checkpointer saves and restores (``global_step`` reads and writes its step)
        self.train_state = TrainState()
        self.wrapped: torch.nn.Module = model
        self._run: Run | None = None  # built whole by fit() (see the class docstring)
        self.last_metrics: dict[str, float] = {}
        self._stragglers: Stragglers | None = None  # per-rank timing (world > 1, rank 0 judges)
        #: device events around forward and backward where the device has them (issue 31)
        self._device_times: stragglers.DeviceTimes | None = None
        self._mark: Callable[[], None] = lambda: None  # DeviceTimes.mark, else nothing
        #: rank 0's clock for ``checkpoint.every_s`` (seconds; tests inject their own)
        self.clock: Callable[[], float] = time.monotonic
        # issue 26: a recipe's hook after every optimizer step (on every rank; uniref50
        # samples on rank 0 at monitoring.sample_frequency), and one that derives metrics
        # from the aggregated evaluation (the perplexity bound exp(eval_loss)).
        self.after_step = after_step
        self.finish_eval = finish_eval
        self._norms: dict[str, Any] = {}  # per-layer squared norms at the coming log point
        #: ``on_epoch_end(epoch, epochs, train_loss, eval_metrics)``, every rank, after each
        #: epoch's evaluation (``Built.on_epoch_end``: a seed's own epoch summary lines).
        self.on_epoch_end: Callable[[int, int, float, dict[str, float]], None] | None = None

    @property
    def preempt_requested(self) -> bool:
        """True once a configured signal arrived on this rank."""
        return self._run is not None and self._run.preemption.requested

    @property
    def checkpointer(self) -> Checkpointer:
        """Every checkpoint of the run (from ``fit()`` on)."""
        return self._r.checkpointer

    @property
    def _beat(self) -> Heartbeat:
        """Progress for ddp.supervise (issue 30)."""
        return self._r.beat

    @property
    def _preemption(self) -> Preemption:
        return self._r.preemption

    @property
    def _vote(self) -> Vote:
        """The ranks' vote (tests read its CPU buffers)."""
        return self._r.preemption.vote

    # ---- the run ------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train, evaluate, checkpoint and export; returns a summary dict.

        Joins the job through ``ddp.init()`` when the script did not already.
        """
        cfg = self.config
        ctx = ddp.get_context() or ddp.init(
            backend=cfg.ddp.backend, device=cfg.ddp.device, timeout=cfg.ddp.timeout_s
        )
        self.train_state.samples, self.train_state.finished = 0, False  # this run's own
        run = self._run = Run(cfg, ctx, self.clock, self.global_step)
        exit_code = 1  # W&B's run state on the way out (issue 27.6): failed unless set
        try:
            run.preemption.install()
            summary = self._fit()
            exit_code = 0
            return summary
        except Preempted:
            exit_code = PREEMPTED_EXIT_CODE
            raise
        except SystemExit:
            raise
        except BaseException as exc:
            if ctx.world_size > 1:
                run.checkpointer.close(timeout=30)  # die() skips `finally`
                run.loggers.close(exit_code)  # so is wandb.finish() on rank 0
                parts.die(ctx.rank, exc)
            raise
        finally:
            run.checkpointer.close()
            if self._stragglers is not None:
                self._stragglers.close()
            run.preemption.restore()
            run.loggers.close(exit_code)

    def _fingerprint(self) -> None:
        """``env-JOBID.json`` beside metrics.jsonl (every rank: one gather of node hashes)."""
        from ddp import fingerprint
        from ddp.loggers import metrics_path

        path = metrics_path(self.config)
        if self.config.logging.fingerprint and path is not None:
            fingerprint.record(path.parent, self.ctx)

    def _open_stragglers(self) -> None:
        """Per-rank timing: the hosts once (one gather at start); rank 0 keeps ranks.jsonl."""
        from ddp import fingerprint
        from ddp.loggers import metrics_path

        lc = self.config.logging
        if self.ctx.world_size < 2 or not lc.straggler_factor:
            return
        hosts = [str(h) for h in ddp.all_gather_object(fingerprint.node_name())]
        path = metrics_path(self.config) if self.ctx.is_main else None
        self._stragglers = Stragglers(
            self.ctx.world_size,
            hosts,
            lc.straggler_factor,
            lc.straggler_points,
            lc.straggler_min_s,
            path.parent / "ranks.jsonl" if path is not None else None,
        )
        self._stragglers.open()
        new_event = stragglers.device_event_factory(self.ctx.device)
        if new_event is not None:  # CUDA/ROCm/XPU; CPU keeps the host timers
            self._device_times = stragglers.DeviceTimes(new_event, time.perf_counter)
            self._mark = self._device_times.mark

    def _fit(self) -> dict[str, Any]:
        cfg, ckpt, run = self.config, self.checkpointer, self._r
        factor, warmup = self._setup_model()
        ckpt.open()
        state = ckpt.load()
        if state is not None:
            self.train_state.load_state_dict(state)
            ckpt.restore_model(state, self.wrapped)
        self.loggers.open_metrics(self.global_step)
        self._fingerprint()
        self._open_stragglers()
        t_start = time.perf_counter()
        summary: dict[str, Any] = {"steps": 0, "train_loss": float("nan")}
        eval_metrics: dict[str, float] = {}
        evaluated_last = False
        if cfg.training.max_steps is not None and self.global_step >= cfg.training.max_steps:
            # A finished run started again (resume: auto) trains nothing more.
            log.info(
                "max_steps=%d already reached at step %d", cfg.training.max_steps, self.global_step
            )
            self.train_state.finished = True
        first = state["phase"] if state else 0
        for pi, phase in enumerate(parts.phases(self.config)):
            if self.train_state.finished:
                break
            if pi < first or (cfg.phases and cfg.phases[pi].skip):
                if pi >= first:
                    log.info("phase %s skipped", phase.name)
                continue
            resume = state if state is not None and state["phase"] == pi else None
            state = None
            loss, evaluated_last, eval_metrics = self._run_phase(
                pi, phase, factor, warmup, resume, eval_metrics
            )
            if not math.isnan(loss):
                summary["train_loss"] = loss
        if self.eval_data is not None and not evaluated_last:
            eval_metrics = self.evaluate()
            if run.preemption.in_eval:  # training is over and saved; resume evaluates
                self._exit_preempted()
            self.loggers.eval(eval_metrics, self.global_step)
            self._keep_best(eval_metrics)
        return self._finish(summary, eval_metrics, t_start)

    def _setup_model(self) -> tuple[float, int]:
        """Per-rank seeds, device, memory options, the DDP wrapper; (LR factor, warmup)."""
        ctx, cfg = self.ctx, self.config
        t, d = cfg.training, cfg.ddp
        random.seed(t.seed + ctx.rank)
        torch.manual_seed(t.seed + ctx.rank)  # per-rank streams (dropout, masks); DDP syncs weights
        model = self.model.to(ctx.device)
        parts.apply_memory_options(cfg, model, ctx.device)
        if d.strategy == "fsdp":
            self.wrapped = ddp.wrap(
                model,
                "fsdp",
                blocks=d.fsdp_blocks,
                cpu_offload=d.cpu_offload,
                reshard_after_forward=d.reshard_after_forward,
                mixed_precision=d.fsdp_mixed_precision,
                activation_checkpointing=d.activation_checkpointing,
            )
        else:
            self.wrapped = ddp.wrap(
                model,
                find_unused_parameters=d.find_unused_parameters,
                gradient_as_bucket_view=d.gradient_as_bucket_view,
                static_graph=d.static_graph,
                bucket_cap_mb=d.bucket_cap_mb,
            )
        world = ctx.world_size
        factor, warmup = cfg.scale_factor(world), cfg.scaled_warmup(world)
        log_config_notes()  # the seed's key spellings and the scaling rule, once
        log.info(
            "world=%d effective batch=%d (%d x accum %d x %d ranks) lr=%.4g (x%.4g, %s rule) "
            "warmup=%d precision=%s",
            world,
            cfg.effective_batch(world),
            t.batch_size,
            t.accum,
            world,
            cfg.scaled_lr(world),
            factor,
            cfg.scaling.rule
            + ("" if cfg.scaling.by == "world" else f" by batch / {cfg.scaling.base_batch_size}"),
            warmup,
            cfg.precision,
        )
        return factor, warmup

    def _finish(
        self, summary: dict[str, Any], eval_metrics: dict[str, float], t_start: float
    ) -> dict[str, Any]:
        elapsed = time.perf_counter() - t_start
        # on the device: NCCL, the default group on GPUs, carries no CPU tensors
        count = torch.tensor([float(self.train_state.samples)], device=self.ctx.device)
        samples = ddp.reduce_sum(count).item()
        summary.update(eval_metrics)
        summary.update(
            steps=self.global_step,
            samples=int(samples),
            samples_per_s=samples / elapsed if elapsed > 0 else 0.0,
            elapsed_s=elapsed,
            peak_memory_mb=parts.peak_memory_mb(self.ctx.device),
        )
        final = self.checkpointer.export(self.wrapped, self.global_step)
        if final is not None:
            summary["final_model"] = final
        log.info("done: %s", ", ".join(f"{k}={fmt(v)}" for k, v in summary.items()))
        return summary

    # ---- one phase: its data, optimizer and schedule, then epochs ------------------------
    def _prepare_phase(
        self,
        pi: int,
        phase: parts.Phase,
        factor: float,
        warmup: int,
        resume: dict[str, Any] | None,
    ) -> tuple[DataLoader, parts.GlobalOrderSampler, LoopState]:
        ctx, cfg = self.ctx, self.config
        t = cfg.training
        data = self.train_data
        if phase.max_samples is not None and phase.max_samples < length(data):
            data = Subset(data, range(phase.max_samples))
        sampler = parts.GlobalOrderSampler(
            length(data), ctx.world_size, ctx.rank, t.batch_size, t.shuffle, t.seed, t.drop_last
        )
        loader = DataLoader(
            data,
            batch_size=t.batch_size,
            sampler=sampler,
            num_workers=cfg.data.num_workers,
            pin_memory=cfg.data.pin_memory,
            collate_fn=self.collate_fn,
            persistent_workers=cfg.data.num_workers > 0,
            generator=torch.Generator().manual_seed(t.seed),  # the global RNG stays untouched
        )
        n_batches = math.ceil(sampler.num_samples / t.batch_size)
        total = math.ceil(n_batches / t.accum) * phase.epochs
        # Steps done before this phase began (from the checkpoint on resume), so the
        # schedule horizon is the same in a resumed run as in an uninterrupted one.
        start = resume.get("phase_start_step", 0) if resume else self.global_step
        if t.max_steps is not None:
            total = min(total, max(0, t.max_steps - start))
        opt = parts.make_optimizer(cfg, self.wrapped, phase.lr * factor)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, parts.lr_lambda(warmup, total, cfg.optim.schedule, cfg.optim.min_lr_ratio)
        )
        scaler = torch.amp.GradScaler(ctx.device.type) if cfg.precision == "fp16" else None
        loop = LoopState(
            pi,
            0,
            0,
            n_batches,
            start,
            opt,
            sched,
            scaler,
            per_batch=t.batch_size * ctx.world_size,
            accum=t.accum,
        )
        if resume is not None:
            self.checkpointer.restore_loop(resume, loop, phase.lr * factor, self.wrapped)
        self.loggers.start_phase(phase.name, total, self.global_step - start)
        return loader, sampler, loop

    def _run_phase(
        self,
        pi: int,
        phase: parts.Phase,
        factor: float,
        warmup: int,
        resume: dict[str, Any] | None,
        eval_metrics: dict[str, float],
    ) -> tuple[float, bool, dict[str, float]]:
        """Epochs of one phase; (last mean loss, evaluated at the end, eval metrics)."""
        loader, sampler, loop = self._prepare_phase(pi, phase, factor, warmup, resume)
        run = self._r
        every = self.config.training.eval_every_n_epochs
        last_loss, evaluated = float("nan"), False
        try:
            for epoch in range(loop.epoch, phase.epochs):
                sampler.set_epoch(epoch)
                sampler.start = loop.samples_done()  # in the epoch's global order
                loop.epoch = epoch
                loop.n_batches = loop.batch + sampler.batches_left()
                loss = self._train_epoch(loader, sampler, loop)
                last_loss = last_loss if math.isnan(loss) else loss
                if self.train_state.finished:
                    break
                evaluated = bool(self.eval_data is not None and every and (epoch + 1) % every == 0)
                if evaluated:
                    eval_metrics = self.evaluate()
                    if run.preemption.in_eval:  # resume re-runs this evaluation, then goes on
                        self._save(loop, at=(epoch, loop.n_batches))
                        self._exit_preempted()
                    self.loggers.eval(eval_metrics, self.global_step, epoch)
                    self._keep_best(eval_metrics)
                # Only now: an evaluation cut short saves (epoch, n_batches), whose sample
                # count needs this run's first position (``base``, a resumed remainder).
                loop.batch = loop.base = 0
                if self.on_epoch_end is not None:
                    self.on_epoch_end(epoch, phase.epochs, loss, eval_metrics if evaluated else {})
                self._save(loop, at=(epoch + 1, 0))
        finally:
            self.loggers.end_phase()
        return last_loss, evaluated, eval_metrics

    def _keep_best(self, eval_metrics: dict[str, float]) -> None:
        """``checkpoint.best`` (issue 27.3): decided identically on every rank from the
        already all-reduced metrics, so it adds no sync; see Checkpointer.keep_best."""
        self.checkpointer.keep_best(self.wrapped, eval_metrics, self.global_step)

    def _save(self, loop: LoopState, at: tuple[int, int]) -> None:
        """Checkpoint the run's state objects; a resumed run starts at ``at``."""
        loop.resume_at = at
        self.checkpointer.save(loop, self.wrapped, self.train_state)
        self._preemption.saved()  # checkpoint.every_s counts from the latest checkpoint

    # ---- preemption (the flags are the Preemption's: ddp.preemption) ---------------------
    def _settle_vote(self, loop: LoopState) -> None:
        """At max_steps or the epoch's end: act on a signal the ranks agree on there."""
        if self._preemption.settle():
            self._preempt(loop)

    def _preempt(self, loop: LoopState) -> None:
        log.warning(
            "preemption signal: saving at step %d and exiting %d",
            self.global_step,
            PREEMPTED_EXIT_CODE,
        )
        self._save(loop, at=loop.after_batches())
        self._exit_preempted()

    def _exit_preempted(self) -> None:
        """After the preemption checkpoint: wait for it, requeue (SLURM), exit 75."""
        self._preemption.exit(self.checkpointer.wait, self.global_step)
