"""The training loop's building blocks: sampler, batches, schedule, optimizer, memory
options and the fail-fast exit. Each is small and has no state of the run, so the
Trainer (``ddp.trainer``) reads as the loop itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch.utils.data import Sampler

from ddp import rank_logs
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
    #: This rank's host seconds since the last log point in ddp.stragglers.PHASES
    #: (data wait, forward, backward + collective + optimizer).
    times: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])

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
        self.times = [0.0, 0.0, 0.0]


def phases(config: TrainConfig) -> list[Phase]:
    """The run's phases with the training section's values where a phase sets none."""
    t = config.training
    if not config.phases:
        return [Phase("train", t.epochs, config.optim.lr, t.max_samples)]
    return [
        Phase(
            p.name or f"phase{i + 1}",
            t.epochs if p.epochs is None else p.epochs,
            config.optim.lr if p.lr is None else p.lr,
            t.max_samples if p.max_samples is None else p.max_samples,
        )
        for i, p in enumerate(config.phases)
    ]


class GlobalOrderSampler(Sampler[int]):
    """Each epoch's samples in one global order, the same for every world size; a
    position in it is a plain sample count, so a run resumes on any number of ranks.

    The order is a pseudo-random permutation of ``range(n)`` keyed by (seed, epoch)
    (identity without ``shuffle``), computed on the fly by a Feistel network with cycle
    walking: no index list is ever built, so memory does not grow with the dataset.

    Consumption: a micro-batch of the whole job takes the next ``world * batch_size``
    positions of the order (a chunk); rank ``r`` takes chunk positions ``r, r + world,
    ...`` (DistributedSampler's striding, within the chunk). ``start`` is the number of
    positions consumed before this run's first micro-batch of the epoch: after a resume
    on another world size it need not be a multiple of the new chunk. The last, partial
    chunk is padded to a multiple of ``world`` with the first positions of the epoch's
    order (at most ``world - 1`` samples seen twice in an epoch, as DistributedSampler
    does), or cut down to one with ``drop_last`` (at most ``world - 1`` unseen).
    """

    def __init__(
        self,
        n: int,
        num_replicas: int,
        rank: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.n, self.world, self.rank, self.batch_size = n, num_replicas, rank, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_samples(self) -> int:
        """Samples per rank in a whole epoch (DistributedSampler's ``num_samples``)."""
        return self._per_rank(self.n)

    def _per_rank(self, remaining: int) -> int:
        chunk = self.world * self.batch_size
        full, rest = divmod(max(0, remaining), chunk)
        tail = rest // self.world if self.drop_last else -(-rest // self.world)
        return full * self.batch_size + tail

    def batches_left(self) -> int:
        """This rank's micro-batches from ``start`` to the epoch's end."""
        return -(-self._per_rank(self.n - self.start) // self.batch_size)

    def __len__(self) -> int:
        return self._per_rank(self.n - self.start)

    def positions(self, block: int = 1 << 16) -> Iterator[np.ndarray]:
        """This rank's positions in the epoch's global order, from ``start``, in blocks."""
        w, b, n = self.world, self.batch_size, self.n
        p = min(self.start, n)
        chunk = w * b
        full, rest = divmod(n - p, chunk)
        inner = self.rank + w * np.arange(b, dtype=np.int64)
        per = max(1, block // b)
        for c0 in range(0, full, per):
            c = np.arange(c0, min(full, c0 + per), dtype=np.int64)
            yield (p + c[:, None] * chunk + inner[None, :]).ravel()
        if rest:
            keep = (rest // w) * w if self.drop_last else -(-rest // w) * w
            tail = p + full * chunk + np.arange(self.rank, keep, w, dtype=np.int64)
            yield tail % n  # padding: the first positions of the epoch's order again

    def order(self, pos: np.ndarray) -> np.ndarray:
        """Sample indices at global positions ``pos`` of this epoch's order."""
        if not self.shuffle:
            return pos
        return feistel_permute(pos, self.n, _round_keys(self.seed, self.epoch))

    def __iter__(self) -> Iterator[int]:
        for pos in self.positions():
            yield from self.order(pos).tolist()


def _round_keys(seed: int, epoch: int, rounds: int = 4) -> list[int]:
    digest = hashlib.blake2b(f"ddp-order/{seed}/{epoch}".encode(), digest_size=8 * rounds)
    return [int.from_bytes(digest.digest()[8 * i : 8 * i + 8], "little") for i in range(rounds)]


def feistel_permute(x: np.ndarray, n: int, keys: list[int]) -> np.ndarray:
    """A bijection of ``range(n)`` evaluated at ``x`` (vectorised): a balanced Feistel
    network over the smallest even power of two >= n, cycle-walking values >= n back
    into range (each walk ends because the network is a bijection of the larger
    domain). Expected walks per value: below 4."""
    if n <= 1:
        return np.zeros_like(x)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keyv = [np.uint64(k) for k in keys]

    def net(v: np.ndarray) -> np.ndarray:
        left, right = v >> np.uint64(half), v & mask
        with np.errstate(over="ignore"):
            for k in keyv:
                f = (right + k) * np.uint64(0x9E3779B97F4A7C15)
                f ^= f >> np.uint64(29)
                f *= np.uint64(0xBF58476D1CE4E5B9)
                f ^= f >> np.uint64(32)
                left, right = right, left ^ (f & mask)
        return (left << np.uint64(half)) | right

    y = net(x.astype(np.uint64))
    out_of_range = y >= np.uint64(n)
    while out_of_range.any():
        y[out_of_range] = net(y[out_of_range])
        out_of_range = y >= np.uint64(n)
    return y.astype(np.int64)


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


# What grad_sync and apply_memory_options call on a model they found the attribute on
# (duck-typed with hasattr, so a wrapper or another library's model works too).
class _FSDP2Module(Protocol):  # torch.distributed.fsdp.FSDPModule
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None: ...


class _DDPModule(Protocol):  # torch.nn.parallel.DistributedDataParallel
    def no_sync(self) -> contextlib.AbstractContextManager[Any]: ...


class _HFCheckpointing(Protocol):  # transformers' PreTrainedModel
    def gradient_checkpointing_enable(self) -> None: ...


class _CheckpointingFlag(Protocol):  # this project's models (DiT, CrowdBT)
    gradient_checkpointing: bool


def grad_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Gradients are reduced across ranks only when ``sync`` (the last micro-batch of an
    accumulation group): DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync``."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        cast(_FSDP2Module, model).set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(model, "no_sync"):  # DDP
        return cast(_DDPModule, model).no_sync()
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
            cast(_HFCheckpointing, model).gradient_checkpointing_enable()
        elif hasattr(model, "gradient_checkpointing"):
            cast(_CheckpointingFlag, model).gradient_checkpointing = True
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
        try:
            rank_logs.drain()  # the traceback into the job log before the launcher ends
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
    a one-sample dataset) and one agreement per batch on stopping (a round of the ranks'
    CPU tree, :func:`ddp.dist.any_rank`; evaluation is not the hot loop).
    """
    if not lockstep:
        for batch in loader:
            if stop():
                return
            yield batch, 1.0
        return
    from torch.utils.data import DataLoader

    import ddp

    n = max(ddp.all_gather_object(len(loader)))
    it, spare = iter(loader), None
    for _ in range(n):
        if ddp.dist.any_rank(stop()):
            return
        batch = next(it, None)
        if batch is not None:
            spare = batch if spare is None else spare
            yield batch, 1.0
            continue
        if spare is None:
            spare = next(iter(DataLoader(pad, batch_size=1, collate_fn=loader.collate_fn)))
        yield spare, 0.0
