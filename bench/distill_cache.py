#!/usr/bin/env python3
"""distill: phase-2 steps/s with the teacher cache vs the teacher run on every batch.

Both arms are the real recipe, ``python -m ddp distill`` with phase 1 skipped, on the
same locally built models and corpus (a BERT teacher of ``--teacher-width`` x
``--teacher-layers`` and a 2-layer student of ``--student-width``, WordPiece tokenizer,
``--texts`` generated sentences; nothing is downloaded). ``cache`` reads the teacher's
embeddings from the run directory's cache (built once per round, in a fresh run
directory, and timed: ``built_s`` in its key file); ``online`` is
``--teacher_cache false``: the frozen teacher embeds each batch inside the step.

Figures: the median over rounds (arms alternate order each round) of the steady-state
step time from the recipe's own metrics.jsonl (log points after the first, which holds
the warm-up); the one-time cost of building the cache; and after how many epochs the
cache has paid for itself: ``built_s / (steps_per_epoch x (t_online - t_cache))``.

Usage: python bench/distill_cache.py [--rounds 3] [--epochs 2] [--texts 512]
       [--batch 32] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def make_models(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    from tests.ddp import _distill_models as dm

    texts = dm.corpus(args.texts, 1)
    (root / "train.txt").write_text("\n".join(texts) + "\n")
    return {
        "teacher": dm.encoder(root / "teacher", args.teacher_width, 1, texts, args.teacher_layers),
        "student": dm.encoder(root / "student", args.student_width, 2, texts, 2),
        "train": root / "train.txt",
    }


def run_arm(arm: str, m: dict[str, Path], out: Path, args: argparse.Namespace) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    argv = [
        sys.executable,
        "-m",
        "ddp",
        "distill",
        "--config",
        "configs/distill.yaml",
        "--teacher_model",
        str(m["teacher"]),
        "--student_model",
        str(m["student"]),
        "--train_data",
        str(m["train"]),
        "--output_dir",
        str(out),
        "--skip_phase1",
        "--phase2_epochs",
        str(args.epochs),
        "--batch_size",
        str(args.batch),
        "--teacher_cache",
        "true" if arm == "cache" else "false",
        "--set",
        "logging.progress=plain",
        f"logging.every_n_steps={args.every}",
        f"ddp.device={args.device}",
        "checkpoint.save_final=false",
        "checkpoint.every_n_steps=0",
    ]
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT / 'src'}:{ROOT}",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS=str(args.threads),
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"{arm} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if r["kind"] == "train"][1:]
    steps = max(r["step"] for r in records if r["kind"] == "train")
    built = 0.0
    if arm == "cache":  # the cache's own cost: its build, less the teacher's load (both arms)
        built = json.loads((out / "teacher_cache" / "train.json").read_text())["built_s"]
        loaded = re.search(r"teacher .* loaded in ([0-9.]+) s", done.stderr + done.stdout)
        built -= float(loaded.group(1)) if loaded else 0.0
    return {"step_s": statistics.median(times), "built_s": built, "steps": steps, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--every", type=int, default=4, help="log point every N steps")
    p.add_argument("--teacher-width", type=int, default=384)
    p.add_argument("--teacher-layers", type=int, default=6)
    p.add_argument("--student-width", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="distill-bench-") as tmp:
        root = Path(tmp)
        m = make_models(root, args)
        res: dict[str, list[dict[str, float]]] = {"cache": [], "online": []}
        for r in range(args.rounds):
            for arm in ("cache", "online") if r % 2 == 0 else ("online", "cache"):
                res[arm].append(run_arm(arm, m, root / f"run_{arm}", args))
    t_c = statistics.median(x["step_s"] for x in res["cache"])
    t_o = statistics.median(x["step_s"] for x in res["online"])
    built = statistics.median(x["built_s"] for x in res["cache"])
    ratios = sorted(
        o["step_s"] / c["step_s"] for c, o in zip(res["cache"], res["online"], strict=True)
    )
    per_epoch = res["cache"][0]["steps"] / args.epochs
    even = built / (per_epoch * (t_o - t_c)) if t_o > t_c else float("inf")
    print(
        f"teacher {args.teacher_width}x{args.teacher_layers}, student {args.student_width}x2, "
        f"{args.texts} texts, batch {args.batch}, {per_epoch:.0f} steps/epoch, device "
        f"{args.device}, {args.rounds} rounds"
    )
    print(f"phase 2 with cache:    {1 / t_c:8.2f} steps/s ({t_c * 1e3:.1f} ms/step)")
    print(f"phase 2, teacher/step: {1 / t_o:8.2f} steps/s ({t_o * 1e3:.1f} ms/step)")
    print(
        f"speedup {t_o / t_c:.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]; cache built once in "
        f"{built:.2f} s (encode + write, the teacher's load apart); pays for itself after "
        f"{even:.2f} epochs"
    )


if __name__ == "__main__":
    main()
