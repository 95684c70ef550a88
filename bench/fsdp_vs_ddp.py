#!/usr/bin/env python3
"""FSDP2 vs DDP through ddp.wrap: per-rank memory, speed and checkpoint time (CPU, Gloo).

Model: 8 blocks of Linear(D, D) + GELU in an nn.ModuleList (D = --dim), AdamW. On each
of W ranks (W from --worlds) it reports:

- the bytes this rank holds for parameters + gradients + optimizer state after one step
  (local shards under FSDP: ``DTensor.to_local()``), and the ratio
  fsdp / (ddp / W) (goal <= 1.1, the rest a constant: unsharded biases and the step);
- steady-state samples/s of fsdp vs ddp (median of --rounds paired rounds of --steps);
- the sharded checkpoint's save time (every rank writes its shards, rank 0 adds the meta
  file; ddp.checkpoint.manager) vs rank 0's ``torch.save`` of the full gathered state;
- how long a save blocks the training loop, through the trainer's own
  ``Checkpointer.save`` with its defaults (async: DCP's ``async_save``, finalized in a
  thread) vs ``Checkpointer(background=False)`` (sync) vs gathering the full state and
  ``torch.save`` from rank 0: the time the save call takes, and the extra wall time of
  a save followed by --steps training steps over the same steps without a save
  (includes the background write competing with training for the CPU, and any wait
  for it at the end), both the slowest rank's, median of --rounds rounds in rotating
  order. ``--saves-only`` runs just this part.

Usage: python bench/fsdp_vs_ddp.py [--worlds 2,4] [--dim 1024] [--rounds 5] [--steps 20]
       [--saves-only]
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


def model(dim: int):
    import torch
    from torch import nn

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(8)
            )

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    return Stack()


def held_bytes(net, opt) -> int:
    def local(t):
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


def save_full(net, opt, path: Path) -> None:
    """The alternative to a sharded save: gather the full model and optimizer state and
    ``torch.save`` it from rank 0 (every rank takes part in the gathers)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from ddp import fsdp

    full = fsdp.full_state_dict(net)
    osd = get_optimizer_state_dict(
        net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        torch.save({"model": full, "optimizer": osd}, path)
    dist.barrier()


def save_times(dim: int) -> tuple[float, float]:
    """(sharded save s, torch.save of the gathered full state s)."""
    import torch
    import torch.distributed as dist

    import ddp
    from ddp.checkpoint import sharded

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
    save_full(net, opt, d / "full.pt")
    t_full = time.perf_counter() - t0
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    return t_sharded, t_full


def blocked_by_saves(dim: int, rounds: int, steps: int, batch: int = 32) -> dict[str, float]:
    """Per arm: (median s the save call blocks, median extra s of save + steps over steps),
    the slowest rank's (see the module docstring)."""
    import torch
    import torch.distributed as dist

    import ddp
    from ddp.checkpoint.manager import Checkpointer, LoopState, TrainState
    from ddp.config import TrainConfig

    net = ddp.wrap(model(dim), "fsdp")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x = torch.randn(batch, dim)

    def train(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            net(x).pow(2).mean().backward()
            opt.step()

    train(2)
    box = [tempfile.mkdtemp(prefix="bench-fsdp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    d = Path(box[0])
    cfg = TrainConfig.from_dict(
        {"ddp": {"strategy": "fsdp"}, "checkpoint": {"dir": str(d / "ck"), "keep_last": 1}}
    )
    ctx = ddp.get_context()
    cps = {"async": Checkpointer(cfg, ctx), "sync": Checkpointer(cfg, ctx, background=False)}
    loop = LoopState(0, 0, 0, 10**6, 0, opt, sched, None)
    step = [0]

    def save(arm: str) -> None:
        step[0] += 1
        if arm in cps:
            cps[arm].save(loop, net, TrainState(step[0]))
            return
        save_full(net, opt, d / "full.pt")

    arms = ["none", "async", "sync", "full"]
    for arm in arms[1:]:
        save(arm)  # warm-up: the checkpoint group, DCP's imports, the page cache
        cps["async"].wait()
    blocked: dict[str, list[float]] = {a: [] for a in arms[1:]}
    total: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            dist.barrier()
            t0 = time.perf_counter()
            if arm != "none":
                save(arm)
                t_save = time.perf_counter() - t0
            train(steps)
            cps["async"].wait()  # a save still running is part of this arm's cost
            dist.barrier()
            t = time.perf_counter() - t0
            worst = max(ddp.all_gather_object((t_save if arm != "none" else 0.0, t)))
            if arm != "none":
                blocked[arm].append(worst[0])
            total[arm].append(worst[1])
    for cp in cps.values():
        cp.close()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    base = statistics.median(total["none"])
    out = {"loop_s_without_save": round(base, 3)}
    for arm in arms[1:]:
        out[f"{arm}_save_blocks_s"] = round(statistics.median(blocked[arm]), 3)
        out[f"{arm}_extra_loop_s"] = round(statistics.median(total[arm]) - base, 3)
    return out


def worker(dim: int, rounds: int, steps: int, saves_only: bool = False) -> None:
    import logging

    import torch.distributed as dist

    import ddp

    ctx = ddp.init(backend="gloo")
    logging.getLogger("ddp").setLevel(logging.WARNING)
    if saves_only:
        saves = blocked_by_saves(dim, rounds, steps)
        if ctx.is_main:
            print(
                json.dumps({"world": ctx.world_size, "dim": dim, "steps": steps, **saves}),
                flush=True,
            )
        dist.barrier()
        ddp.shutdown()
        return
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
    blocked = blocked_by_saves(dim, rounds, steps)
    mems = ddp.all_gather_object((mem_ddp, mem_fsdp))
    if ctx.is_main:
        w = ctx.world_size
        worst = max(f for _, f in mems)
        print(
            json.dumps(
                {
                    "world": w,
                    "params": sum(p.numel() for p in model(dim).parameters()),
                    "ddp_bytes_per_rank": mems[0][0],
                    "fsdp_bytes_per_rank_max": worst,
                    "fsdp_over_ddp_per_w": round(worst / (mems[0][0] / w), 3),
                    "fsdp_samples_per_s_vs_ddp": round(statistics.median(ratios), 3),
                    "speed_spread": [round(min(ratios), 3), round(max(ratios), 3)],
                    "sharded_save_s": round(statistics.median(s for s, _ in saves), 3),
                    "full_torch_save_s": round(statistics.median(f for _, f in saves), 3),
                    **blocked,
                }
            ),
            flush=True,
        )
    dist.barrier()
    ddp.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--saves-only",
        action="store_true",
        help="only how long each kind of save blocks the training loop",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.dim, args.rounds, args.steps, args.saves_only)
        return
    for world in (int(w) for w in args.worlds.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(
                    [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
                ),
            }
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--dim",
                str(args.dim),
                "--rounds",
                str(args.rounds),
                "--steps",
                str(args.steps),
            ]
            cmd += ["--saves-only"] if args.saves_only else []
            procs.append(subprocess.Popen(cmd, env=env))
        rc = max(p.wait() for p in procs)
        if rc:
            sys.exit(rc)


if __name__ == "__main__":
    main()
