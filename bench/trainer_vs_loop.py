#!/usr/bin/env python3
"""Trainer vs a hand-written minimal DDP loop: samples/s ratio (goal >= 0.97x).

MLP 256-512-512-10, fp32, SGD, batch 64 per rank, world 2, Gloo, OMP_NUM_THREADS=1.
Each round runs every arm (order alternating) on the same data; each arm's figure is
the median of the per-round paired ratios (hand loop time / arm time = arm samples/s /
loop samples/s), so slow drift on a shared machine cancels out.
Arms: ``trainer`` (ddp.trainer.Trainer), ``trainer_nosig`` (the Trainer without
preemption signals: shows the cost of the per-step preemption all_reduce), and two
optional peers, each skipped with a note when its package is not importable:
``fabric`` (Lightning Fabric: strategy="ddp", torchelastic-style environment) and
``accelerate`` (HF Accelerate: Accelerator(cpu=True), MULTI_CPU).
Every arm builds its model, wrapper and loader inside the timed region, like the loop.

Usage: python bench/trainer_vs_loop.py [--rounds 7] [--steps 150] [--arms trainer,fabric]
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
ALL_ARMS = ("trainer", "trainer_nosig", "fabric", "accelerate")
OPTIONAL = {"fabric": "lightning_fabric", "accelerate": "accelerate"}
LABELS = {
    "trainer": "Trainer",
    "trainer_nosig": "Trainer without preemption check",
    "fabric": "Lightning Fabric",
    "accelerate": "HF Accelerate",
}


def mlp():  # noqa: ANN201
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def hand_loop(data, steps: int) -> float:  # noqa: ANN001
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    dist.barrier()
    t0 = time.perf_counter()
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    dist.barrier()
    return time.perf_counter() - t0


def trainer_run(data, steps: int, signals: list[str]) -> float:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    cfg = TrainConfig.from_dict({
        "training": {"batch_size": 64, "epochs": 1, "max_steps": steps},
        "optim": {"name": "sgd", "lr": 0.01},
        "checkpoint": {"dir": None},
        "logging": {"every_n_steps": 50, "progress": "off"},
        "preemption": {"signals": signals},
    })  # fmt: skip

    def step(model, batch):  # noqa: ANN001, ANN202
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    dist.barrier()
    t0 = time.perf_counter()
    Trainer(mlp(), data, cfg, step).fit()
    dist.barrier()
    return time.perf_counter() - t0


def fabric_run(data, steps: int) -> float:  # noqa: ANN001
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
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        opt.step()
    dist.barrier()
    return time.perf_counter() - t0


def accelerate_run(data, steps: int) -> float:  # noqa: ANN001
    """HF Accelerate, Accelerator(cpu=True): WORLD_SIZE > 1 selects MULTI_CPU and the
    existing Gloo group is reused. prepare() shards the shuffled loader with its own
    BatchSamplerShard (one RNG synchronised across ranks, disjoint batches of 64 per rank,
    steps + 1 batches per rank, as with DistributedSampler here): the idiomatic path."""
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
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
    dist.barrier()
    return time.perf_counter() - t0


def run_arm(arm: str, data, steps: int) -> float:  # noqa: ANN001
    if arm == "loop":
        return hand_loop(data, steps)
    if arm == "trainer":
        return trainer_run(data, steps, ["SIGUSR1", "SIGTERM"])
    if arm == "trainer_nosig":
        return trainer_run(data, steps, [])
    if arm == "fabric":
        return fabric_run(data, steps)
    return accelerate_run(data, steps)


def available_arms(requested: list[str]) -> list[str]:
    arms = []
    for arm in requested:
        mod = OPTIONAL.get(arm)
        if mod and importlib.util.find_spec(mod) is None:
            print(f"note: skipping arm {arm!r}: package {mod!r} is not importable", flush=True)
            continue
        arms.append(arm)
    return arms


def worker(rounds: int, steps: int, arms: list[str]) -> None:
    import logging

    import torch

    import ddp

    ctx = ddp.init(backend="gloo")
    logging.getLogger("ddp").setLevel(logging.WARNING)
    for name in ("lightning.fabric", "lightning_fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.WARNING)
    g = torch.Generator().manual_seed(0)
    n = 64 * 2 * (steps + 1)
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    for arm in ["loop", *arms]:  # warm-up every path
        run_arm(arm, data, 10)
    ratios: dict[str, list[float]] = {arm: [] for arm in arms}
    sps = []
    for r in range(rounds):
        order = ["loop", *arms]
        if r % 2:
            order.reverse()
        t = {arm: run_arm(arm, data, steps) for arm in order}
        for arm in arms:
            ratios[arm].append(t["loop"] / t[arm])
        sps.append(steps * 64 * ctx.world_size / t["loop"])
        if ctx.is_main:
            parts = " ".join(f"{arm} {t[arm]:.3f}s ({t['loop'] / t[arm]:.3f}x)" for arm in arms)
            print(f"round {r}: loop {t['loop']:.3f}s {parts}", flush=True)
    if ctx.is_main:
        print(f"hand loop: {statistics.median(sps):.0f} samples/s (world {ctx.world_size})")
        for arm in arms:
            med = statistics.median(ratios[arm])
            spread = f"[{min(ratios[arm]):.3f}-{max(ratios[arm]):.3f}]"
            goal = " (goal >= 0.97x)" if arm == "trainer" else ""
            print(f"{LABELS[arm]} / hand loop samples/s, median of {rounds} paired rounds: "
                  f"{med:.3f}x {spread}{goal}")  # fmt: skip
    ddp.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=150)
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
        worker(args.rounds, args.steps, requested)
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
               "--steps", str(args.steps), "--arms", ",".join(arms)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env))
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
