#!/usr/bin/env python3
"""UniRef50 at scale: memory and start-up flat in the data's size, preparation and loader speed.

Four figures, each a ratio taken in the same run:

1. peak resident memory per rank (``ru_maxrss``) training the uniref50 recipe for
   ``--steps`` steps on 2 Gloo ranks from the store of a ``--large`` FASTA vs from a
   ``--small`` one (same model): goal <= 1.2;
2. time from process start to the first optimizer step, same two runs: goal <= 1.5;
3. preparation throughput (MB/s of FASTA) of ``python -m ddp.data prepare-fasta`` on the
   large file, beside pyfaidx's ``.fai`` index build of the same file (skipped with a
   note when pyfaidx is not installed): goal >= 200 MB/s;
4. loader throughput (samples/s of one rank's DataLoader over the store with the
   recipe's batch and the Trainer's sampler) / samples/s one rank of the model consumes
   in training: goal >= 20.

The FASTA files are synthetic (``scripts/make_fasta.py --size``), written to ``--dir``
once and reused (delete them to regenerate). Stores are prepared before training (as
on a login node), so the training runs measure only training.

Peak RSS is each process's VmHWM (its own image; ``ru_maxrss`` would carry over the
parent's before exec). The training figures are medians of ``--rounds`` paired rounds.

Usage: python bench/data_scale.py [--small 20M] [--large 2G] [--steps 20] [--rounds 3]
       [--dir /tmp/ddp-bench-data]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts")]

WORKER = r"""
import json, os, sys, time
t_launch = float(sys.argv[2])
import torch
import ddp
from ddp import recipes
from ddp.trainer import Trainer
recipe = recipes.get("uniref50")
cfg = recipes.resolve(recipe, None, ["recipe.data=" + sys.argv[1], "training.max_steps=" + sys.argv[3],
                                     "checkpoint.dir=null", "logging.progress=off",
                                     "logging.every_n_steps=1000"])
ddp.init(backend="gloo")
t_build = time.time()
built = recipe.build(cfg)
t_build = time.time() - t_build
first = {}
def step(model, batch):
    out = built.step_fn(model, batch)
    first.setdefault("t", time.time())
    return out
summary = Trainer(built.model, built.train_data, cfg, step, None).fit()
# VmHWM: this process image's own peak (ru_maxrss would include the parent's image
# before exec, which Linux carries over).
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print("RESULT " + json.dumps({"rank": ddp.get_rank(), "rss_mb": hwm / 1024,
      "first_step_s": first["t"] - t_launch, "build_s": t_build,
      "samples_per_s": summary["samples_per_s"], "n_train": len(built.train_data)}))
ddp.shutdown()
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(store: Path, steps: int, world: int = 2) -> list[dict]:
    """One 2-rank run of the recipe from ``store``; each rank's result."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=f"{ROOT / 'src'}:{ROOT}",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(store), repr(time.time()), str(steps)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        o, e = p.communicate(timeout=900)
        if p.returncode:
            raise SystemExit(f"training run failed ({p.returncode}):\n{e[-3000:]}")
        out += [json.loads(line[7:]) for line in o.splitlines() if line.startswith("RESULT ")]
    return out


def loader_rate(store: Path, seconds: float = 3.0) -> float:
    """Samples/s of one rank's DataLoader (batch 16, workers 0) over the store."""
    import torch
    from torch.utils.data import DataLoader

    from ddp import parts
    from ddp.config import TrainConfig
    from ddp.recipes import uniref50

    cfg = TrainConfig.from_dict(
        {**uniref50.DEFAULTS, "recipe": {**uniref50.DEFAULTS["recipe"], "data": str(store)}}
    )
    train, _ = uniref50.open_data(cfg)
    bs = cfg.training.batch_size
    sampler = parts.GlobalOrderSampler(len(train), 2, 0, bs, True, 0)
    n, t0 = 0, time.perf_counter()
    for batch in DataLoader(train, batch_size=bs, sampler=sampler):
        n += batch.shape[0]
        if time.perf_counter() - t0 > seconds:
            break
    torch.set_num_threads(1)
    return n / (time.perf_counter() - t0)


PREP = r"""
import json, sys, time
from pathlib import Path
fasta, out, arm = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
if arm == "ddp":
    from ddp.data.fasta import prepare_fasta
    prepare_fasta(fasta, out)
else:
    import pyfaidx
    pyfaidx.Faidx(str(fasta), rebuild=True).close()
dt = time.perf_counter() - t0
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"mb_s": fasta.stat().st_size / 1e6 / dt, "rss_mb": hwm / 1024}))
"""


def prepare(fasta: Path) -> tuple[Path, dict, dict | None]:
    """(store, our arm, pyfaidx's arm or None): MB/s and peak RSS, each in its own process,
    the store prepared afresh, the file read from the page cache by both."""
    import importlib.util

    out = fasta.with_name(fasta.name + ".tokens")
    shutil.rmtree(out, ignore_errors=True)
    with open(fasta, "rb") as fh:  # warm the page cache for both arms
        while fh.read(1 << 24):
            pass
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{ROOT}")

    def arm(name: str) -> dict:
        r = subprocess.run(
            [sys.executable, "-c", PREP, str(fasta), str(out), name],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=1800,
        )
        return json.loads(r.stdout.splitlines()[-1])

    ours = arm("ddp")
    faidx = None
    if importlib.util.find_spec("pyfaidx") is None:
        print("  pyfaidx not installed: its arm is skipped (pip install pyfaidx)")
    else:
        faidx = arm("pyfaidx")
        Path(str(fasta) + ".fai").unlink(missing_ok=True)
    return out, ours, faidx


def main() -> None:
    from make_fasta import big_fasta, parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", default="20M")
    ap.add_argument("--large", default="2G")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="paired training rounds")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ddp-bench-data"))
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in ("small", "large"):
        size = parse_size(getattr(args, name))
        f = args.dir / f"synthetic_{getattr(args, name)}.fasta"
        if not f.is_file():
            t0 = time.perf_counter()
            big_fasta(f, size)
            print(
                f"generated {f} ({f.stat().st_size / 1e6:,.0f} MB) in {time.perf_counter() - t0:.0f}s"
            )
        files[name] = f
    stores, rates = {}, {}
    for name, f in files.items():
        stores[name], ours, faidx = prepare(f)
        rates[name] = (ours["mb_s"], faidx["mb_s"] if faidx else None)
        fx = f"{faidx['mb_s']:,.0f} MB/s, peak RSS {faidx['rss_mb']:,.0f} MB" if faidx else "n/a"
        print(
            f"prepare {name} ({f.stat().st_size / 1e6:,.0f} MB): {ours['mb_s']:,.0f} MB/s, "
            f"peak RSS {ours['rss_mb']:,.0f} MB; pyfaidx index: {fx}"
        )
    rss_r, t1_r, consume = [], [], []
    for rnd in range(args.rounds):  # paired rounds, alternating order
        runs = {}
        for name in ("small", "large") if rnd % 2 == 0 else ("large", "small"):
            runs[name] = res = train(stores[name], args.steps)
            print(
                f"round {rnd} train {name}: n_train={res[0]['n_train']:,} "
                + ", ".join(
                    f"rank {r['rank']}: peak RSS {r['rss_mb']:.0f} MB, first step "
                    f"{r['first_step_s']:.2f}s (build {r['build_s']:.2f}s)"
                    for r in res
                )
            )
        rss_r.append(
            max(r["rss_mb"] for r in runs["large"]) / max(r["rss_mb"] for r in runs["small"])
        )
        t1_r.append(
            max(r["first_step_s"] for r in runs["large"])
            / max(r["first_step_s"] for r in runs["small"])
        )
        consume.append(min(r["samples_per_s"] for r in runs["large"]) / 2)  # per rank
    rss, t1 = statistics.median(rss_r), statistics.median(t1_r)
    consume_ = max(consume)
    load = loader_rate(stores["large"])
    ours, faidx = rates["large"]
    print()
    print(
        f"| figure | value | goal |\n|---|---|---|\n"
        f"| peak RSS per rank, large / small store (median of {args.rounds}) | {rss:.2f}x "
        f"[{min(rss_r):.2f}-{max(rss_r):.2f}] | <= 1.2 |\n"
        f"| start to first step, large / small (median) | {t1:.2f}x "
        f"[{min(t1_r):.2f}-{max(t1_r):.2f}] | <= 1.5 |\n"
        f"| prepare-fasta on the large file | {ours:,.0f} MB/s (pyfaidx index: "
        f"{f'{faidx:,.0f} MB/s' if faidx else 'n/a'}) | >= 200 MB/s |\n"
        f"| loader / model samples/s per rank | {load:,.0f} / {consume_:,.0f} = "
        f"{load / consume_:.0f}x | >= 20 |"
    )


if __name__ == "__main__":
    main()
