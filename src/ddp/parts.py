"""The training loop's building blocks: sampler, batches, schedule, optimizer, memory
options and the fail-fast exit. Each is small and has no state of the run, so the
Trainer (``ddp.trainer``) reads as the loop itself.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from ddp.config import TrainConfig
from ddp.errors import ConfigError


@dataclass
class Phase:
    """One stage of a run: seed 000's phases, or the single "train" phase."""

    name: str
    epochs: int
    lr: float
    max_samples: int | None


@dataclass
class LossWindow:
    """Running sums between log points, on the device: added to in place, read only at
    a log point (one collective for all of them)."""

    loss: torch.Tensor
    epoch_loss: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    micro: int = 0
    epoch_micro: int = 0
    t0: float = field(default_factory=time.perf_counter)
    step0: int = 0

    def add(self, out: Any) -> torch.Tensor:
        """Account one micro-batch's output; returns its loss."""
        loss = out["loss"] if isinstance(out, dict) else out
        if isinstance(out, dict):
            for k, v in out.items():
                if k != "loss" and isinstance(v, torch.Tensor):
                    if k in self.extra:
                        self.extra[k].add_(v.detach())
                    else:
                        self.extra[k] = v.detach().float().clone()
        self.loss.add_(loss.detach())
        self.micro += 1
        self.epoch_micro += 1
        return loss

    def reset(self, step: int) -> None:
        self.epoch_loss.add_(self.loss)
        self.loss.zero_()
        for v in self.extra.values():
            v.zero_()
        self.micro, self.t0, self.step0 = 0, time.perf_counter(), step


def phases(config: TrainConfig) -> list[Phase]:
    """The run's phases with the training section's values where a phase sets none."""
    t = config.training
    if not config.phases:
        return [Phase("train", t.epochs, config.optim.lr, t.max_samples)]
    return [
        Phase(p.name or f"phase{i + 1}", t.epochs if p.epochs is None else p.epochs,
              config.optim.lr if p.lr is None else p.lr,
              t.max_samples if p.max_samples is None else p.max_samples)
        for i, p in enumerate(config.phases)
    ]  # fmt: skip


class ResumableSampler(DistributedSampler):
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


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        return batch_len(next(iter(batch.values())))
    if isinstance(batch, list | tuple) and batch:
        return batch_len(batch[0])
    return 1


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
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


def make_optimizer(config: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    o = config.optim
    params = [p for p in model.parameters() if p.requires_grad]
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(
        params, lr=lr, betas=(o.betas[0], o.betas[1]), weight_decay=o.weight_decay
    )


def grad_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Gradients are reduced across ranks only when ``sync`` (the last micro-batch of an
    accumulation group): DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync``."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """No context at all in fp32 (nothing to pay per step), else torch.autocast."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def apply_memory_options(config: TrainConfig, model: torch.nn.Module, dev: torch.device) -> None:
    m = config.memory
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


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if device.type == "xpu" and hasattr(torch.xpu, "max_memory_allocated"):
        return torch.xpu.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    except ImportError:  # pragma: no cover
        return float("nan")


def die(rank: int, exc: BaseException) -> None:
    """Report a failure naming the rank and end this process now.

    A failure on one rank of a multi-rank job ends that process at once (``os._exit``);
    the peers' next collective then fails on the closed socket, so the whole job ends in
    seconds instead of waiting out the collective timeout. The caller finishes a
    checkpoint still being written first (bounded), so a failure right after a save
    does not lose that save.
    """
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


def eval_batches(
    loader: Any, lockstep: bool, stop: Callable[[], bool], pad: Any
) -> Iterator[tuple[Any, float]]:
    """(batch, weight) pairs of one evaluation pass; ends early once ``stop()`` is true
    (a preemption signal: act within a batch, not after the pass; SLURM's KillWait is 30 s).

    Under FSDP every forward is a collective, so ranks go in ``lockstep``: as many
    batches as the rank with the most (the others repeat a batch of theirs with weight
    0, adding nothing; a rank with no batch at all borrows the first sample of ``pad``,
    a one-sample dataset) and one agreement per batch on stopping (a CPU all_reduce on
    the control group; evaluation is not the hot loop).
    """
    if not lockstep:
        for batch in loader:
            if stop():
                return
            yield batch, 1.0
        return
    import torch.distributed as tdist
    from torch.utils.data import DataLoader

    import ddp

    n = max(ddp.all_gather_object(len(loader)))
    it, spare = iter(loader), None
    for _ in range(n):
        flag = torch.tensor([1.0 if stop() else 0.0])
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=ddp.dist.cpu_group())
        if flag.numpy()[0]:
            return
        batch = next(it, None)
        if batch is not None:
            spare = batch if spare is None else spare
            yield batch, 1.0
            continue
        if spare is None:
            spare = next(iter(DataLoader(pad, batch_size=1, collate_fn=loader.collate_fn)))
        yield spare, 0.0
