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

Usage: python bench/trainer_vs_loop.py [--rounds 7] [--steps 150] [--epochs 3] [--arms ...]
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


def mlp():  # noqa: ANN201
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def hand_loop(data, epochs: int, ckpt_dir: str | None = None) -> float:  # noqa: ANN001
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
                state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                         "epoch": epoch}  # fmt: skip
                torch.save(state, os.path.join(ckpt_dir, f"epoch_{epoch}.pt"))
            dist.barrier()
    dist.barrier()
    return time.perf_counter() - t0


def trainer_run(data, epochs: int, signals: list[str], ckpt_dir: str | None) -> float:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    base = TrainConfig()  # the defaults, with only the model's own settings changed
    cfg = TrainConfig.from_dict({
        "training": {"batch_size": 64, "epochs": epochs},
        "optim": {"name": "sgd", "lr": 0.01},
        "checkpoint": {"dir": ckpt_dir},
        "preemption": {"signals": signals},
    })  # fmt: skip
    assert cfg.logging.every_n_steps == base.logging.every_n_steps

    def step(model, batch):  # noqa: ANN001, ANN202
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    dist.barrier()
    t0 = time.perf_counter()
    Trainer(mlp(), data, cfg, step).fit()
    dist.barrier()
    return time.perf_counter() - t0


def fabric_run(data, epochs: int) -> float:  # noqa: ANN001
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
        accelerator="cpu", strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=1, precision="32-true", plugins=[TorchElasticEnvironment()],
    )  # fmt: skip
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


def accelerate_run(data, epochs: int) -> float:  # noqa: ANN001
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


def run_arm(arm: str, data, epochs: int) -> float:  # noqa: ANN001
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
        print(f"{baselines[0]}: {statistics.median(sps):.0f} samples/s (world {ctx.world_size}, "
              f"{epochs} epochs of {len(data) // (64 * ctx.world_size)} steps)")  # fmt: skip
        for arm in arms:
            med = statistics.median(ratios[arm])
            spread = f"[{min(ratios[arm]):.3f}-{max(ratios[arm]):.3f}]"
            goal = {"trainer": " (goal >= 1.0x)", "trainer_defaults": " (goal >= 0.97x)"}
            print(f"{LABELS[arm]} / {BASELINE.get(arm, 'loop')} samples/s, median of {rounds} "
                  f"paired rounds: {med:.3f}x {spread}{goal.get(arm, '')}")  # fmt: skip
    ddp.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=150, help="steps per rank in all")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument(
        "--arms", default=",".join(ALL_ARMS),
        help=f"comma-separated arms compared with the hand loop (default: all available: "
        f"{','.join(ALL_ARMS)})",
    )  # fmt: skip
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    requested = [a.strip() for a in args.arms.split(",") if a.strip()]
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
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
               "WORLD_SIZE": str(args.world), "LOCAL_WORLD_SIZE": str(args.world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--epochs", str(args.epochs),
               "--arms", ",".join(arms)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env))
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
