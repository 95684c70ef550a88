#!/usr/bin/env python3
"""Checkpoint save (atomic: temp file, fsync, rename, fsync dir, `latest` pointer) vs a
bare ``torch.save`` of the same state to the same directory. Goal <= 1.2x.

State: a ~25M-parameter MLP with its AdamW state (~300 MB). Rounds alternate the
order; the figure is the median of per-round paired ratios.
Usage: python bench/checkpoint_save.py [--rounds 5] [--dir DIR] [--width 2048]
(Sharded FSDP saves, sync vs async: ``bench/fsdp_vs_ddp.py --saves-only``.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> None:
    import torch

    from ddp import checkpoint as ckpt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--width", type=int, default=2048)
    args = ap.parse_args()
    w = args.width
    model = torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, w)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "global_step": 1}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        bare_path = os.path.join(d, "bare.pt")

        def bare() -> float:
            os.sync()  # both arms start with no dirty pages pending (not timed)
            t0 = time.perf_counter()
            torch.save(state, bare_path)
            return time.perf_counter() - t0

        durable: list[float] = []

        def atomic() -> float:
            os.sync()
            t0 = time.perf_counter()
            pending = ckpt.begin_save(state, d, 1, keep_last=1, background=True)
            blocking = time.perf_counter() - t0
            pending.wait()  # not counted: the trainer overlaps it with training
            durable.append(time.perf_counter() - t0)
            return blocking

        bare(), atomic()  # warm-up: page cache, allocator
        ratios = []
        for r in range(args.rounds):
            first, second = (bare, atomic) if r % 2 == 0 else (atomic, bare)
            t = {first.__name__: first(), second.__name__: second()}
            ratios.append(t["atomic"] / t["bare"])
            print(
                f"round {r}: bare {t['bare']:.3f}s atomic (blocking) {t['atomic']:.3f}s "
                f"ratio {ratios[-1]:.3f}; until durable {durable[-1]:.3f}s",
                flush=True,
            )
        size = os.path.getsize(bare_path) / 2**20
    print(
        f"state {size:.0f} MB; atomic save / torch.save, median of {args.rounds} rounds: "
        f"{statistics.median(ratios):.3f}x (goal <= 1.2x)"
    )
    print(
        "(time the training loop blocks; fsync + rename + `latest` run in a background "
        "thread, median until durable "
        f"{statistics.median(durable[1:]):.3f}s)"
    )


if __name__ == "__main__":
    main()
