#!/usr/bin/env python3
"""Trainer vs a hand-written minimal DDP loop: samples/s ratio (goal >= 0.97x).

MLP 256-512-512-10, fp32, SGD, batch 64 per rank, world 2, Gloo, OMP_NUM_THREADS=1.
Each round runs both (order alternating) on the same data; the figure is the median
of the per-round paired ratios, so slow drift on a shared machine cancels out.
A third arm runs the Trainer without preemption signals, which shows the cost of
the per-step preemption all_reduce.

Usage: python bench/trainer_vs_loop.py [--rounds 7] [--steps 150]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def worker(rounds: int, steps: int) -> None:
    import logging

    import torch

    import ddp

    ctx = ddp.init(backend="gloo")
    logging.getLogger("ddp").setLevel(logging.WARNING)
    g = torch.Generator().manual_seed(0)
    n = 64 * 2 * (steps + 1)
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    hand_loop(data, 10)  # warm-up both paths
    trainer_run(data, 10, ["SIGUSR1", "SIGTERM"])
    ratios, ratios_nosig, sps = [], [], []
    for r in range(rounds):
        arms = ["loop", "trainer", "trainer_nosig"]
        if r % 2:
            arms.reverse()
        t = {}
        for arm in arms:
            if arm == "loop":
                t[arm] = hand_loop(data, steps)
            elif arm == "trainer":
                t[arm] = trainer_run(data, steps, ["SIGUSR1", "SIGTERM"])
            else:
                t[arm] = trainer_run(data, steps, [])
        ratios.append(t["loop"] / t["trainer"])
        ratios_nosig.append(t["loop"] / t["trainer_nosig"])
        sps.append(steps * 64 * ctx.world_size / t["loop"])
        if ctx.is_main:
            print(f"round {r}: loop {t['loop']:.3f}s trainer {t['trainer']:.3f}s "
                  f"(no signals {t['trainer_nosig']:.3f}s) ratio {ratios[-1]:.3f}", flush=True)  # fmt: skip
    if ctx.is_main:
        print(f"hand loop: {statistics.median(sps):.0f} samples/s (world {ctx.world_size})")
        print(f"Trainer / hand loop samples/s, median of {rounds} paired rounds: "
              f"{statistics.median(ratios):.3f}x (goal >= 0.97x)")  # fmt: skip
        print(f"Trainer without preemption check / hand loop: "
              f"{statistics.median(ratios_nosig):.3f}x")  # fmt: skip
    ddp.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.rounds, args.steps)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(args.world), "LOCAL_WORLD_SIZE": str(args.world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds),
               "--steps", str(args.steps)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env))
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
