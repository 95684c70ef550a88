#!/usr/bin/env python3
"""The uniref50 SEDD recipe under the Trainer vs the same model and loss in a plain DDP loop.

Both arms build the recipe (``configs/uniref50-tiny.yaml`` by default, no checkpoints, no
evaluation, no samples) and train ``--steps`` optimizer steps on the same data: ``recipe``
hands it to :class:`ddp.trainer.Trainer` (preemption vote, log points, schedule, clipping,
as a user runs it); ``loop`` wraps the same model in DDP and runs DistributedSampler +
DataLoader, zero_grad / the recipe's step function (its SEDD loss) / backward / clip /
AdamW step. Each round runs both arms (order alternating) in fresh processes, timed inside
from the build to the last step; the figure is the median of the per-round ratios
(loop time / recipe time = recipe steps/s over loop steps/s), goal >= 0.97x.

CPU (default): world 2, Gloo, OMP_NUM_THREADS=1, started torchrun-style.
GPU: ``--device cuda --model small --precision bf16``: one process per arm on one GPU,
SEDD small (768 wide, 12 blocks, 12 heads), batch 16 x 512 positions; prints tokens/s and
peak GPU memory of each arm as well.

Usage: python bench/sedd_vs_loop.py [--rounds 5] [--steps 60]
       python bench/sedd_vs_loop.py --device cuda --model small --precision bf16 [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sets(args: argparse.Namespace) -> list[str]:
    out = [
        f"training.max_steps={args.steps}",
        "training.epochs=1000",
        "checkpoint.dir=null",
        "logging.progress=off",
        "logging.metrics_file=null",
        "recipe.eval_fraction=0",
        "monitoring.sample_frequency=0",
        f"precision={args.precision}",
        f"ddp.device={args.device}",
        "memory.max_memory_fraction=null",
        "data.num_workers=0",
        "training.accum=1",
    ]
    if args.model == "small":  # SEDD small at the recipe's defaults, one micro-batch a step
        out += [
            "model.d_model=768",
            "model.n_layers=12",
            "model.n_heads=12",
            "model.cond_dim=128",
            "model.max_len=512",
            "model.dropout=0.1",
            "training.batch_size=16",
        ]
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank of one arm; rank 0 prints a JSON line with its time and memory."""
    import torch

    import ddp
    from ddp import recipes

    recipe = recipes.get("uniref50")
    cfg = recipes.resolve(recipe, args.config, _sets(args))
    ctx = ddp.init(backend=cfg.ddp.backend, device=cfg.ddp.device)
    dev = ctx.device
    ddp.barrier()
    t0 = time.perf_counter()
    built = recipe.build(cfg)
    if args.worker == "recipe":
        from ddp.trainer import Trainer

        summary = Trainer(built.model, built.train_data, cfg, built.step_fn).fit()
        steps = summary["steps"]
    else:
        torch.manual_seed(cfg.training.seed + ctx.rank)
        model = built.model.to(dev)
        wrapped = ddp.wrap(model)
        sampler = torch.utils.data.DistributedSampler(
            built.train_data, ctx.world_size, ctx.rank, seed=cfg.training.seed
        )
        loader = torch.utils.data.DataLoader(
            built.train_data, batch_size=cfg.training.batch_size, sampler=sampler
        )
        opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.optim.lr, weight_decay=0.0)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        steps, epoch = 0, 0
        while steps < args.steps:
            sampler.set_epoch(epoch)
            for batch in loader:
                batch = batch.to(dev, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                    loss = built.step_fn(wrapped, batch)["loss"]
                loss.backward()
                torch.nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.optim.grad_clip)
                opt.step()
                steps += 1
                if steps == args.steps:
                    break
            epoch += 1
        loss.item()  # the last step has finished on the device
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ddp.barrier()
    elapsed = time.perf_counter() - t0
    if ctx.is_main:
        mem = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else 0.0
        tokens = steps * cfg.training.batch_size * ctx.world_size * cfg.model["max_len"]
        print(
            json.dumps(
                {
                    "arm": args.worker,
                    "s": elapsed,
                    "steps": steps,
                    "tokens_per_s": tokens / elapsed,
                    "peak_mib": mem,
                }
            ),
            flush=True,
        )
    ddp.shutdown()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_arm(arm: str, args: argparse.Namespace) -> dict:
    world = 1 if args.device == "cuda" else args.world
    port, procs = _port(), []
    for rank in range(world):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
            ),
        }
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            arm,
            "--steps",
            str(args.steps),
            "--device",
            args.device,
            "--model",
            args.model,
            "--precision",
            args.precision,
            "--config",
            str(args.config),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"{arm}: a rank failed: {[p.returncode for p in procs]}")
    line = [x for x in outs[0].splitlines() if x.startswith("{")][-1]
    return json.loads(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default="tiny", choices=("tiny", "small"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--config", default=str(ROOT / "configs" / "uniref50-tiny.yaml"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    ratios, rows = [], {"recipe": [], "loop": []}
    for r in range(args.rounds):
        order = ("recipe", "loop") if r % 2 == 0 else ("loop", "recipe")
        got = {arm: run_arm(arm, args) for arm in order}
        for arm in got:
            rows[arm].append(got[arm])
        ratios.append(got["loop"]["s"] / got["recipe"]["s"])
        print(
            f"round {r + 1}: recipe {got['recipe']['s']:.2f} s, loop {got['loop']['s']:.2f} s, "
            f"ratio {ratios[-1]:.3f}",
            flush=True,
        )
    world = 1 if args.device == "cuda" else args.world
    print(
        f"\nuniref50 SEDD, {args.model} model, {args.precision}, {args.device}, world {world}, "
        f"{args.steps} steps, {args.rounds} rounds"
    )
    for arm in ("recipe", "loop"):
        med = statistics.median(x["tokens_per_s"] for x in rows[arm])
        sps = statistics.median(x["steps"] / x["s"] for x in rows[arm])
        mem = max(x["peak_mib"] for x in rows[arm])
        extra = f", peak {mem:.0f} MiB" if args.device == "cuda" else ""
        print(f"{arm:7s}: {sps:.2f} steps/s, {med:,.0f} tokens/s{extra}")
    print(
        f"recipe / loop steps/s: {statistics.median(ratios):.3f}x "
        f"[{min(ratios):.3f}-{max(ratios):.3f}] (goal >= 0.97x)"
    )


if __name__ == "__main__":
    main()
