#!/usr/bin/env python3
"""Trainer vs a hand-written minimal DDP loop: samples/s ratio (goal >= 0.97x).

MLP 256-512-512-10, fp32, SGD, batch 64 per rank, world 2, Gloo, OMP_NUM_THREADS=1,
``--epochs`` epochs of ``--steps`` steps in all. Each round runs every arm (order
alternating) on the same data; each arm's figure is the median of the per-round paired
ratios (its baseline's time / arm time = arm samples/s / baseline samples/s), so slow
drift on a shared machine cancels out. Two settings, each against its own hand loop:

- checkpoints off, against ``loop`` (DistributedSampler + set_epoch, DDP, zero_grad /
  forward / backward / step): ``trainer`` (the Trainer's defaults with
  ``checkpoint.dir: null``: preemption vote every step, a log point every 50 steps),
  ``trainer_nosig`` (no preemption signals: the vote's cost), and two optional peers,
  each skipped with a note when its package is not importable: ``fabric`` (Lightning
  Fabric, strategy="ddp", torchelastic-style environment) and ``accelerate`` (HF
  Accelerate, Accelerator(cpu=True), MULTI_CPU);
- what a user gets, against ``loop_ckpt`` (the same loop, rank 0 ``torch.save`` of model
  and optimizer at each epoch's end, then a barrier): ``trainer_defaults`` (every
  default on: a checkpoint at each epoch's end with digest, fsync and ``latest``, the
  directory lock, the preemption vote, log points, the final export).

Every arm builds its model, wrapper and loader inside the timed region, like the loop.
The ddp logger is set to WARNING so that log lines do not interleave with the results
(the log points' collectives still run).

One device (``--device cuda``, or ``--world 1``): one process, no process group, each
tool with its single-device defaults, timed in the steady state (see
:func:`single_device`), for a small MLP (``--model mlp``: per-step Python overhead
shows) and a small transformer LM (``--model lm``: the GPU's arithmetic dominates).

Usage: python bench/trainer_vs_loop.py [--rounds 7] [--steps 150] [--epochs 3] [--arms ...]
       python bench/trainer_vs_loop.py --device cuda --model mlp|lm [--rounds 7] [--steps 400]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL_ARMS = ("trainer", "trainer_nosig", "fabric", "accelerate", "trainer_defaults")
BASELINE = {"trainer_defaults": "loop_ckpt"}  # every other arm: "loop"
OPTIONAL = {"fabric": "lightning_fabric", "accelerate": "accelerate"}
LABELS = {
    "trainer": "Trainer",
    "trainer_nosig": "Trainer without preemption check",
    "fabric": "Lightning Fabric",
    "accelerate": "HF Accelerate",
    "trainer_defaults": "Trainer, all defaults (epoch checkpoints)",
}


def mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def hand_loop(data, epochs: int, ckpt_dir: str | None = None) -> float:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    dist.barrier()
    t0 = time.perf_counter()
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if ckpt_dir is not None:
            if dist.get_rank() == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": opt.state_dict(),
                    "epoch": epoch,
                }
                torch.save(state, os.path.join(ckpt_dir, f"epoch_{epoch}.pt"))
            dist.barrier()
    dist.barrier()
    return time.perf_counter() - t0


def trainer_run(data, epochs: int, signals: list[str], ckpt_dir: str | None) -> float:
    import torch
    import torch.distributed as dist

    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    base = TrainConfig()  # the defaults, with only the model's own settings changed
    cfg = TrainConfig.from_dict(
        {
            "training": {"batch_size": 64, "epochs": epochs},
            "optim": {"name": "sgd", "lr": 0.01},
            "checkpoint": {"dir": ckpt_dir},
            "preemption": {"signals": signals},
        }
    )
    assert cfg.logging.every_n_steps == base.logging.every_n_steps

    def step(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    dist.barrier()
    t0 = time.perf_counter()
    Trainer(mlp(), data, cfg, step).fit()
    dist.barrier()
    return time.perf_counter() - t0


def fabric_run(data, epochs: int) -> float:
    """Lightning Fabric on processes launched outside it (as torchrun/srun would).

    TorchElasticEnvironment is passed explicitly (auto-detection needs TORCHELASTIC_RUN_ID,
    which would change what the other arms see); it reads RANK/WORLD_SIZE/LOCAL_RANK and
    requires devices * num_nodes == WORLD_SIZE. Fabric reuses the existing Gloo group.
    setup_dataloaders swaps the RandomSampler for DistributedSampler(shuffle=True, seed=0)
    and calls set_epoch on each iteration, which matches the loop.
    """
    import torch
    import torch.distributed as dist
    from lightning_fabric import Fabric
    from lightning_fabric.plugins.environments import TorchElasticEnvironment
    from torch.utils.data import DataLoader, DistributedSampler

    dist.barrier()
    t0 = time.perf_counter()
    fabric = Fabric(
        accelerator="cpu",
        strategy="ddp",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=1,
        precision="32-true",
        plugins=[TorchElasticEnvironment()],
    )
    fabric.launch()
    assert fabric.world_size == dist.get_world_size() == 2, fabric.world_size
    assert fabric.global_rank == dist.get_rank()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    # _FabricModule keeps the DDP wrapper as _forward_module (.module is the bare MLP)
    assert isinstance(model._forward_module, torch.nn.parallel.DistributedDataParallel)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=64, shuffle=True))
    assert isinstance(loader.sampler, DistributedSampler), type(loader.sampler)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            opt.step()
    dist.barrier()
    return time.perf_counter() - t0


def accelerate_run(data, epochs: int) -> float:
    """HF Accelerate, Accelerator(cpu=True): WORLD_SIZE > 1 selects MULTI_CPU and the
    existing Gloo group is reused. prepare() shards the shuffled loader with its own
    BatchSamplerShard (one RNG synchronised across ranks, disjoint batches of 64 per rank,
    the same batches per rank as DistributedSampler here): the idiomatic path."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    from torch.utils.data import DataLoader

    dist.barrier()
    t0 = time.perf_counter()
    acc = Accelerator(cpu=True)
    assert acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type
    assert acc.num_processes == dist.get_world_size() == 2, acc.num_processes
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=64, shuffle=True))
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    assert len(loader) == len(data) // (64 * 2), len(loader)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
    dist.barrier()
    return time.perf_counter() - t0


def run_arm(arm: str, data, epochs: int) -> float:
    import tempfile

    import torch.distributed as dist

    if arm in ("loop", "trainer", "trainer_nosig", "fabric", "accelerate"):
        return {
            "loop": lambda: hand_loop(data, epochs),
            "trainer": lambda: trainer_run(data, epochs, ["SIGUSR1", "SIGTERM"], None),
            "trainer_nosig": lambda: trainer_run(data, epochs, [], None),
            "fabric": lambda: fabric_run(data, epochs),
            "accelerate": lambda: accelerate_run(data, epochs),
        }[arm]()
    # The checkpointing arms: a fresh directory per run, named by rank 0 (shared /tmp).
    box = [tempfile.mkdtemp(prefix="bench-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    try:
        if arm == "loop_ckpt":
            return hand_loop(data, epochs, box[0])
        return trainer_run(data, epochs, ["SIGUSR1", "SIGTERM"], box[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            import shutil

            shutil.rmtree(box[0], ignore_errors=True)


def available_arms(requested: list[str]) -> list[str]:
    arms = []
    for arm in requested:
        mod = OPTIONAL.get(arm)
        if mod and importlib.util.find_spec(mod) is None:
            print(f"note: skipping arm {arm!r}: package {mod!r} is not importable", flush=True)
            continue
        arms.append(arm)
    return arms


def worker(rounds: int, steps: int, epochs: int, arms: list[str]) -> None:
    import logging

    import torch

    import ddp

    ctx = ddp.init(backend="gloo")
    logging.getLogger("ddp").setLevel(logging.WARNING)
    for name in ("lightning.fabric", "lightning_fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.WARNING)
    g = torch.Generator().manual_seed(0)
    n = 64 * ctx.world_size * max(1, steps // epochs)  # one epoch: steps / epochs batches
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    baselines = sorted({BASELINE.get(arm, "loop") for arm in arms})
    for arm in [*baselines, *arms]:  # warm-up every path
        run_arm(arm, data, 1)
    ratios: dict[str, list[float]] = {arm: [] for arm in arms}
    sps = []
    for r in range(rounds):
        order = [*baselines, *arms]
        if r % 2:
            order.reverse()
        t = {arm: run_arm(arm, data, epochs) for arm in order}
        for arm in arms:
            ratios[arm].append(t[BASELINE.get(arm, "loop")] / t[arm])
        sps.append(len(data) * epochs / t[baselines[0]])
        if ctx.is_main:
            times = " ".join(f"{arm} {t[arm]:.3f}s" for arm in order)
            print(f"round {r}: {times}", flush=True)
    if ctx.is_main:
        print(
            f"{baselines[0]}: {statistics.median(sps):.0f} samples/s (world {ctx.world_size}, "
            f"{epochs} epochs of {len(data) // (64 * ctx.world_size)} steps)"
        )
        for arm in arms:
            med = statistics.median(ratios[arm])
            spread = f"[{min(ratios[arm]):.3f}-{max(ratios[arm]):.3f}]"
            goal = {"trainer": " (goal >= 1.0x)", "trainer_defaults": " (goal >= 0.97x)"}
            print(
                f"{LABELS[arm]} / {BASELINE.get(arm, 'loop')} samples/s, median of {rounds} "
                f"paired rounds: {med:.3f}x {spread}{goal.get(arm, '')}"
            )
    ddp.shutdown()


# ---- one device: the loop, the Trainer, Fabric and Accelerate, in the steady state ------
SINGLE_ARMS = ("trainer", "trainer_nosig", "fabric", "accelerate")
SINGLE_LABELS = {**LABELS, "loop": "hand loop"}
SIZES = {  # (batch, default timed steps, default warm-up steps)
    "mlp": (64, 400, 50),
    "lm": (32, 30, 10),
}
LM = {"vocab": 8192, "dim": 768, "layers": 6, "heads": 12, "seq": 256}


class TinyLM:  # namespace only; the module class is built lazily (torch imports late)
    """A GPT-shaped LM: token + position embeddings, ``layers`` pre-norm causal
    TransformerEncoderLayers (dim 768, 12 heads, 4x MLP), a vocabulary head: 55M
    parameters, 8192 tokens per step at batch 32, about 2.5 TFLOP per step."""

    @staticmethod
    def build():
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                d = LM["dim"]
                self.emb = nn.Embedding(LM["vocab"], d)
                self.pos = nn.Parameter(torch.zeros(LM["seq"], d))
                layer = nn.TransformerEncoderLayer(
                    d, LM["heads"], 4 * d, dropout=0.0, batch_first=True, norm_first=True
                )
                self.blocks = nn.TransformerEncoder(layer, LM["layers"], enable_nested_tensor=False)
                self.head = nn.Linear(d, LM["vocab"])

            def forward(self, tok: torch.Tensor) -> torch.Tensor:
                n = tok.shape[1]
                mask = nn.Transformer.generate_square_subsequent_mask(n, device=tok.device)
                h = self.blocks(self.emb(tok) + self.pos[:n], mask=mask, is_causal=True)
                return self.head(h)

        torch.manual_seed(0)
        return Model()


def make_model(kind: str):
    return mlp() if kind == "mlp" else TinyLM.build()


def loss_fn(model, batch, kind: str):
    """The same loss for every arm: cross-entropy over classes (mlp) or next tokens (lm)."""
    import torch

    if kind == "mlp":
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)
    (tok,) = batch
    logits = model(tok[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten())


class Clock:
    """Steady-state step time: ``tick()`` at the top of every step; the device is
    synchronised only at tick ``warmup`` and tick ``warmup + steps`` (two waits per run,
    none in between), so the interval holds exactly ``steps`` whole steps of host and
    device work, each tool's own data movement and bookkeeping included."""

    def __init__(self, device, warmup: int, steps: int) -> None:
        import torch

        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.warmup, self.steps, self.n = warmup, steps, 0
        self.t0 = self.t1 = 0.0
        self.stamps: list[float] = []

    def tick(self) -> None:
        if self.n == self.warmup:
            self.sync()
            self.t0 = time.perf_counter()
        elif self.n == self.warmup + self.steps:
            self.sync()
            self.t1 = time.perf_counter()
        if self.warmup <= self.n <= self.warmup + self.steps:
            self.stamps.append(time.perf_counter())
        self.n += 1

    def step_s(self) -> float:
        """Mean time per step over the window, device work included (the figure)."""
        assert self.t1 > 0, f"only {self.n} steps ran; the data set is too small"
        return (self.t1 - self.t0) / self.steps

    def host_median_s(self) -> float:
        """Median host time between consecutive ticks: where the host is the bottleneck
        (small models) this is the step time with outliers (GC, a neighbour's burst)
        left out, so differences of tens of microseconds between arms resolve."""
        import statistics

        return statistics.median(b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False))


def single_loop(data, kind: str, batch: int, amp: bool, clock: Clock, dev) -> None:
    """The hand-written loop as nanoGPT writes it: non_blocking copies (from pageable
    memory they need no pinning and spare the host a wait for the device each step)."""
    import contextlib

    import torch
    from torch.utils.data import DataLoader

    model = make_model(kind).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    for b in loader:
        clock.tick()
        b = [t.to(dev, non_blocking=True) for t in b]
        opt.zero_grad(set_to_none=True)
        with ctx:
            loss = loss_fn(model, b, kind)
        loss.backward()
        opt.step()


def single_trainer(data, kind: str, batch: int, amp: bool, clock: Clock, signals: bool) -> None:
    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    cfg = TrainConfig.from_dict(
        {
            "training": {"batch_size": batch, "epochs": 1},
            "optim": {"name": "sgd", "lr": 0.01},
            "checkpoint": {"dir": None},
            "preemption": {"signals": ["SIGUSR1", "SIGTERM"] if signals else []},
            "precision": "bf16" if amp else "fp32",
        }
    )

    def step(model, b):
        clock.tick()
        return loss_fn(model, b, kind)

    Trainer(make_model(kind), data, cfg, step).fit()


def single_fabric(data, kind: str, batch: int, amp: bool, clock: Clock, dev) -> None:
    """Fabric's single-device strategy; setup_dataloaders moves batches (non_blocking on
    CUDA) and, with bf16-mixed, forward runs under autocast."""
    import torch
    from lightning_fabric import Fabric
    from torch.utils.data import DataLoader

    fabric = Fabric(
        accelerator="cuda" if dev.type == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if amp else "32-true",
    )
    fabric.launch()
    assert fabric.world_size == 1, fabric.world_size
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=batch, shuffle=True))
    for b in loader:
        clock.tick()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, b, kind)
        fabric.backward(loss)
        opt.step()


def single_accelerate(data, kind: str, batch: int, amp: bool, clock: Clock, dev) -> None:
    """Accelerate as ``python train.py`` on one GPU: prepare() moves batches (blocking
    copies: its DataLoaderConfiguration(non_blocking=False) default) and wraps forward
    in autocast for mixed_precision="bf16". Its state is a process-wide singleton, reset
    here so that each run can choose its own precision."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=dev.type == "cpu", mixed_precision="bf16" if amp else "no")
    assert acc.num_processes == 1, acc.num_processes
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=batch, shuffle=True))
    for b in loader:
        clock.tick()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, b, kind)
        acc.backward(loss)
        opt.step()
    acc.free_memory()  # it keeps references to what it prepared


def single_arm(arm: str, data, kind: str, batch: int, clock: Clock, dev) -> None:
    amp_on = arm.endswith("_bf16")
    base = arm.removesuffix("_bf16")
    if base == "loop":
        single_loop(data, kind, batch, amp_on, clock, dev)
    elif base in ("trainer", "trainer_nosig"):
        single_trainer(data, kind, batch, amp_on, clock, signals=base == "trainer")
    elif base == "fabric":
        single_fabric(data, kind, batch, amp_on, clock, dev)
    elif base == "accelerate":
        single_accelerate(data, kind, batch, amp_on, clock, dev)
    else:
        raise ValueError(arm)


def single_data(kind: str, n: int):
    import torch

    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        return torch.utils.data.TensorDataset(
            torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
        )
    return torch.utils.data.TensorDataset(
        torch.randint(0, LM["vocab"], (n, LM["seq"] + 1), generator=g)
    )


def profile_steps(arm: str, data, kind: str, batch: int, dev, steps: int = 20) -> str:
    """torch.profiler over ``steps`` steady-state steps of one arm: the host calls that
    make the host wait (stream/device synchronisation, blocking copies, scalar reads),
    counted per step, and the ten largest self-CPU-time entries."""
    from torch.profiler import ProfilerActivity, profile

    class Window(Clock):
        def __init__(self) -> None:
            super().__init__(dev, 10, steps)
            self.prof = profile(
                activities=[ProfilerActivity.CPU]
                + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            )

        def tick(self) -> None:
            if self.n == self.warmup:
                self.prof.__enter__()
            super().tick()
            if self.n == self.warmup + self.steps + 1:
                self.prof.__exit__(None, None, None)

    clock = Window()
    single_arm(arm, data, kind, batch, clock, dev)
    events = clock.prof.key_averages()
    watch = (
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaMemcpyAsync",
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::copy_",
        "aten::to",
    )
    counts = {e.key: e.count for e in events if e.key in watch}
    lines = [
        f"profile {arm} ({kind}, {steps} steps): per step "
        + ", ".join(f"{k} {counts.get(k, 0) / steps:g}" for k in watch)
    ]
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=10))
    return "\n".join(lines)


def single_device(args: argparse.Namespace) -> None:
    """Every arm on one device, world 1, in paired rounds (order alternating).

    Per arm and round: the steady-state time per step (:class:`Clock`, after
    ``--warmup`` untimed steps, which absorb cuDNN/cuBLAS handle creation and the
    allocator's first growth) and the peak device memory above what was allocated when
    the arm began (the allocator's own statistics; on the CPU, not measured). Each arm's
    figure is the median of per-round paired ratios to the loop of its precision (fp32
    or bf16 autocast); the Trainer's per-step overhead is the median of the per-round
    differences from that loop, in microseconds.
    """
    import gc
    import logging
    import statistics as st

    import torch

    import ddp

    ctx = ddp.init(device=args.device)
    assert ctx.world_size == 1, "the single-device comparison runs as one process"
    logging.getLogger("ddp").setLevel(logging.WARNING)
    for name in ("lightning.fabric", "lightning_fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.WARNING)
    dev = ctx.device
    batch, steps, warmup = SIZES[args.model]
    steps = args.steps if args.steps != 150 else steps  # 150: the CPU bench's default
    warmup = args.warmup if args.warmup is not None else warmup
    names = [a.strip() for a in (args.arms or ",".join(SINGLE_ARMS)).split(",") if a.strip()]
    unknown = sorted(set(names) - set(SINGLE_ARMS))
    if unknown:
        sys.exit(f"unknown arm(s) {unknown}; choose from {','.join(SINGLE_ARMS)}")
    names = available_arms(names)
    amp = dev.type == "cuda"  # bf16 autocast variants: on the GPU (CPU autocast is another story)
    arms = ["loop", *names] + (["loop_bf16", *(f"{a}_bf16" for a in names)] if amp else [])
    data = single_data(args.model, batch * (warmup + steps + 2))
    print(
        f"device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, "
        f"torch {torch.__version__}, model {args.model}, batch {batch}, {warmup} warm-up + "
        f"{steps} timed steps, {args.rounds} rounds",
        flush=True,
    )
    small = single_data(args.model, batch * 8)
    for arm in arms:  # warm every path once (imports, kernels, autotuning)
        single_arm(arm, small, args.model, batch, Clock(dev, 0, 1), dev)
    t: dict[str, list[float]] = {a: [] for a in arms}
    host: dict[str, list[float]] = {a: [] for a in arms}
    mem: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        for arm in order:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            clock = Clock(dev, warmup, steps)
            single_arm(arm, data, args.model, batch, clock, dev)
            t[arm].append(clock.step_s())
            host[arm].append(clock.host_median_s())
            if dev.type == "cuda":
                mem[arm].append((torch.cuda.max_memory_allocated(dev) - base) / 2**20)
        print(f"round {r}: " + " ".join(f"{a} {t[a][-1] * 1e3:.3f}ms" for a in order), flush=True)

    def paired(a: dict[str, list[float]], arm: str, ref: str) -> list[float]:
        return [x / y for x, y in zip(a[ref], a[arm], strict=True)]

    def span(v: list[float], f: str = ".3f") -> str:
        return f"{st.median(v):{f}} [{min(v):{f}} to {max(v):{f}}]"

    print(
        "\n| arm | ms/step | loop's time / arm's | host median ms/step | loop's / arm's "
        "(host medians) | peak MiB |\n|---|---|---|---|---|---|"
    )
    for arm in arms:
        ref = "loop_bf16" if arm.endswith("_bf16") else "loop"
        peak = f"{st.median(mem[arm]):.0f}" if mem[arm] else "-"
        print(
            f"| {arm} | {st.median(t[arm]) * 1e3:.3f} | {span(paired(t, arm, ref))} | "
            f"{st.median(host[arm]) * 1e3:.3f} | {span(paired(host, arm, ref))} | {peak} |"
        )
    print("(medians over rounds [min to max]; ratios are per-round pairs)")
    for arm in [a for a in arms if a.startswith("trainer")]:
        ref = "loop_bf16" if arm.endswith("_bf16") else "loop"
        diff = [(a - b) * 1e6 for a, b in zip(t[arm], t[ref], strict=True)]
        hdiff = [(a - b) * 1e6 for a, b in zip(host[arm], host[ref], strict=True)]
        print(f"{arm} - {ref}, us/step: {span(diff, '+.1f')}; host medians {span(hdiff, '+.1f')}")
    if args.profile:
        for arm in ("loop", "trainer"):
            print(profile_steps(arm, data, args.model, batch, dev), flush=True)
    ddp.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=150, help="steps per rank in all")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU, world 1 (the single-device comparison)",
    )
    ap.add_argument(
        "--model",
        choices=("mlp", "lm"),
        default="mlp",
        help="single device only: mlp (overhead-bound) or lm (compute-bound)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="single device only: untimed steps before the timed ones",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="single device only: afterwards, profile the loop and the Trainer",
    )
    ap.add_argument(
        "--arms",
        default=None,
        help=f"comma-separated arms compared with the hand loop (default: all available: "
        f"{','.join(ALL_ARMS)})",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cuda" or args.world == 1:
        single_device(args)
        return
    requested = [a.strip() for a in (args.arms or ",".join(ALL_ARMS)).split(",") if a.strip()]
    unknown = sorted(set(requested) - set(ALL_ARMS))
    if unknown or not requested:
        ap.error(f"unknown arm(s) {unknown}; choose from {','.join(ALL_ARMS)}")
    if args.worker:
        worker(args.rounds, args.steps, args.epochs, requested)
        return
    arms = available_arms(requested)
    if not arms:
        sys.exit("no arm left to compare with the hand loop")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(args.world),
            "LOCAL_WORLD_SIZE": str(args.world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--epochs",
            str(args.epochs),
            "--arms",
            ",".join(arms),
        ]
        procs.append(subprocess.Popen(cmd, env=env))
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
