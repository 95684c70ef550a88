#!/usr/bin/env python3
"""FSDP2 vs DDP through ddp.wrap: per-rank memory, speed and checkpoint time (CPU, Gloo).

Model: 8 blocks of Linear(D, D) + GELU in an nn.ModuleList (D = --dim), AdamW. On each
of W ranks (W from --worlds) it reports:

- the bytes this rank holds for parameters + gradients + optimizer state after one step
  (local shards under FSDP: ``DTensor.to_local()``), and the ratio
  fsdp / (ddp / W) (goal <= 1.1, the rest a constant: unsharded biases and the step);
- steady-state samples/s of fsdp vs ddp (median of --rounds paired rounds of --steps);
- the sharded checkpoint's save time (every rank writes its shards, rank 0 adds the meta
  file; ddp.checkpointer) vs rank 0's ``torch.save`` of the full gathered state.

Usage: python bench/fsdp_vs_ddp.py [--worlds 2,4] [--dim 1024] [--rounds 5] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model(dim: int):  # noqa: ANN201
    import torch
    from torch import nn

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(8)
            )

        def forward(self, x):  # noqa: ANN001, ANN202
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    return Stack()


def held_bytes(net, opt) -> int:  # noqa: ANN001
    def local(t):  # noqa: ANN001, ANN202
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in net.parameters():
        total += local(p.detach()).nbytes
        if p.grad is not None:
            total += local(p.grad).nbytes
    for state in opt.state.values():
        for v in state.values():
            if hasattr(v, "nbytes"):
                total += local(v).nbytes
    return total


def run(strategy: str, dim: int, steps: int, batch: int = 32) -> tuple[float, int]:
    import torch
    import torch.distributed as dist

    import ddp

    net = ddp.wrap(model(dim), strategy)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(batch, dim)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        net(x).pow(2).mean().backward()
        opt.step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    return elapsed, held_bytes(net, opt)


def save_times(dim: int) -> tuple[float, float]:
    """(sharded save s, torch.save of the gathered full state s)."""
    import torch
    import torch.distributed as dist

    import ddp
    from ddp import fsdp, sharded

    net = ddp.wrap(model(dim), "fsdp")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(4, dim)).sum().backward()
    opt.step()
    box = [tempfile.mkdtemp(prefix="bench-fsdp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    d = Path(box[0])
    dist.barrier()
    t0 = time.perf_counter()
    sharded.save(d / "sharded", net, opt)
    dist.barrier()
    t_sharded = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = fsdp.full_state_dict(net)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))  # fmt: skip
    if dist.get_rank() == 0:
        torch.save({"model": full, "optimizer": osd}, d / "full.pt")
    dist.barrier()
    t_full = time.perf_counter() - t0
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    return t_sharded, t_full


def worker(dim: int, rounds: int, steps: int) -> None:
    import logging

    import torch.distributed as dist

    import ddp

    ctx = ddp.init(backend="gloo")
    logging.getLogger("ddp").setLevel(logging.WARNING)
    for s in ("ddp", "fsdp"):
        run(s, dim, 2)  # warm-up
    t_ddp, mem_ddp = run("ddp", dim, 1)
    _, mem_fsdp = run("fsdp", dim, 1)
    ratios = []
    for r in range(rounds):
        order = ["ddp", "fsdp"] if r % 2 == 0 else ["fsdp", "ddp"]
        t = {s: run(s, dim, steps)[0] for s in order}
        ratios.append(t["ddp"] / t["fsdp"])
    saves = [save_times(dim) for _ in range(3)]
    mems = ddp.all_gather_object((mem_ddp, mem_fsdp))
    if ctx.is_main:
        w = ctx.world_size
        worst = max(f for _, f in mems)
        print(json.dumps({
            "world": w, "params": sum(p.numel() for p in model(dim).parameters()),
            "ddp_bytes_per_rank": mems[0][0], "fsdp_bytes_per_rank_max": worst,
            "fsdp_over_ddp_per_w": round(worst / (mems[0][0] / w), 3),
            "fsdp_samples_per_s_vs_ddp": round(statistics.median(ratios), 3),
            "speed_spread": [round(min(ratios), 3), round(max(ratios), 3)],
            "sharded_save_s": round(statistics.median(s for s, _ in saves), 3),
            "full_torch_save_s": round(statistics.median(f for _, f in saves), 3),
        }), flush=True)
    dist.barrier()
    ddp.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.dim, args.rounds, args.steps)
        return
    for world in (int(w) for w in args.worlds.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                   "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
            cmd = [sys.executable, __file__, "--worker", "--dim", str(args.dim),
                   "--rounds", str(args.rounds), "--steps", str(args.steps)]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env))
        rc = max(p.wait() for p in procs)
        if rc:
            sys.exit(rc)


if __name__ == "__main__":
    main()
