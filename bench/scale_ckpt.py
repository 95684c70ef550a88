#!/usr/bin/env python3
"""Checkpoint costs per rank against the number of ranks W (issue 28, item 2): bytes each
rank receives during one save, the largest file a save writes, and the CPU time one
rank spends resuming. Fits each against W on a log-log line and projects it to the full
Aurora machine (127,488 ranks) and Frontier (75,264).

Ranks are local processes (Gloo, CPU, a tiny model), one world size at a time. The
bytes are counted by wrapping torch.distributed's collectives during the save (the
result each rank receives: an all-reduce's tensor, the others' parts of an all-gather,
a broadcast's tensor on every rank but its source); object collectives are counted
through the tensor collectives they are made of. With ``--strategy fsdp`` the bytes that
torch.distributed.checkpoint's own save planning moves, and the size of its
``.metadata``, are shown apart: they are DCP's, not the checkpointer's.

Usage: python bench/scale_ckpt.py [--worlds 2,4,8,16,32] [--strategy ddp|fsdp]
       [--src DIR] [--json FILE]
``--src``: the ``src`` directory whose ``ddp`` to measure (default: this checkout's), so
an older checkout can be measured the same way for comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"Aurora": 127_488, "Frontier": 75_264}


# ---- counting what the collectives carry ----------------------------------------------------
class Counter:
    """Wraps torch.distributed's collectives (both the package's names and
    distributed_c10d's, which its object collectives call) while in a ``with`` block."""

    NAMES = (
        "all_reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "gather",
        "scatter",
        "reduce",
        "reduce_scatter_tensor",
        "all_to_all_single",
        "send",
        "recv",
        "barrier",
    )

    def __init__(self) -> None:
        self.received = 0
        self.by_dcp = 0  # of which torch.distributed.checkpoint's own planning carried
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    def _add(self, name: str, nbytes: int) -> None:
        dcp = _from_dcp()
        with self._lock:
            self.received += nbytes
            self.by_dcp += nbytes if dcp else 0
            key = f"dcp:{name}" if dcp else name
            self.calls[key] = self.calls.get(key, 0) + 1

    def _received(self, name: str, args: tuple, kwargs: dict) -> int:
        import torch
        import torch.distributed as tdist

        def size(t: Any) -> int:
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        def arg(i: int, key: str) -> Any:
            return args[i] if len(args) > i else kwargs.get(key)

        me = tdist.get_rank()
        if name in ("all_reduce", "reduce_scatter_tensor", "all_to_all_single", "recv"):
            return size(arg(0, "tensor" if name != "reduce_scatter_tensor" else "output"))
        if name == "broadcast":
            src = arg(1, "src")
            return 0 if src == me else size(arg(0, "tensor"))
        if name == "reduce":
            return size(arg(0, "tensor")) if arg(1, "dst") == me else 0
        if name == "all_gather":
            out, mine = arg(0, "tensor_list"), arg(1, "tensor")
            return sum(size(t) for t in out) - size(mine)
        if name == "all_gather_into_tensor":
            return size(arg(0, "output_tensor")) - size(arg(1, "input_tensor"))
        if name == "gather":
            parts = arg(1, "gather_list") or []
            return sum(size(t) for t in parts) - (size(arg(0, "tensor")) if parts else 0)
        if name == "scatter":
            return 0 if arg(2, "src") == me else size(arg(0, "tensor"))
        return 0  # send, barrier

    def __enter__(self) -> Counter:
        import torch.distributed as tdist
        from torch.distributed import distributed_c10d as c10d

        for name in self.NAMES:
            real = getattr(c10d, name)

            def wrapped(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> Any:
                self._add(_name, self._received(_name, args, kwargs))
                return _real(*args, **kwargs)

            for module in (tdist, c10d):
                if hasattr(module, name):
                    self._saved.append((module, name, getattr(module, name)))
                    setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)
        self._saved.clear()


def _from_dcp() -> bool:
    """Whether torch.distributed.checkpoint (DCP's save planning) made this call."""
    frame = sys._getframe(2)
    while frame is not None:
        if "torch/distributed/checkpoint/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


# ---- one rank ------------------------------------------------------------------------------
def worker(spec: dict[str, Any]) -> None:
    """One rank: two saves (the first warms up: groups, allocators), the second counted;
    then a resume from it, timed in CPU seconds. Writes its figures to ``out/<rank>.json``."""
    import torch
    from torch import nn

    import ddp
    from ddp.checkpoint.manager import Checkpointer, LoopState, TrainState
    from ddp.config import TrainConfig

    ctx = ddp.init(backend="gloo", device="cpu")
    strategy = spec["strategy"]

    def config(resume: str) -> TrainConfig:
        return TrainConfig.from_dict(
            {
                "ddp": {"strategy": strategy},
                "training": {"seed": 1},
                "checkpoint": {"dir": spec["dir"], "keep_last": 2, "resume": resume},
            }
        )

    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = ddp.wrap(
            nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)), strategy=strategy
        )
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        return model, LoopState(0, 0, 2, 10, 0, opt, sched, None, per_batch=4 * ctx.world_size)

    model, loop = build()
    cp = Checkpointer(config("none"), ctx)
    cp.open()
    cp.save(loop, model, TrainState(1))
    cp.wait()
    ddp.barrier()
    with Counter() as save:
        t0 = time.perf_counter()
        cp.save(loop, model, TrainState(2))
        cp.wait()
        save_wall = time.perf_counter() - t0
    ddp.barrier()
    cp.close()
    ddp.barrier()  # the lock is free for the resume
    files = [p for p in Path(spec["dir"]).rglob("*") if p.is_file() and "final" not in p.parts]
    largest = max(files, key=lambda p: p.stat().st_size)
    index = [p.stat().st_size for p in files if p.name == ".metadata"]  # DCP's, FSDP only
    model2, loop2 = build()
    cp2 = Checkpointer(config("auto"), ctx)
    cp2.open()
    with Counter() as resume:
        cpu0 = time.process_time()
        state = cp2.load()
        assert state is not None and state["global_step"] == 2
        cp2.restore_model(state, model2)
        resume_cpu = time.process_time() - cpu0
    cp2.close()
    result = {
        "rank": ctx.rank,
        "received": save.received,
        "received_dcp": save.by_dcp,
        "calls": save.calls,
        "save_s": save_wall,
        "resume_cpu_s": resume_cpu,
        "resume_received": resume.received,
        "largest": largest.stat().st_size,
        "largest_name": str(largest.relative_to(spec["dir"])),
        "files": len(files),
        "dcp_metadata": max(index, default=0),
    }
    (Path(spec["out"]) / f"{ctx.rank}.json").write_text(json.dumps(result))
    ddp.shutdown()


# ---- the launcher ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, strategy: str, src: Path, timeout: float = 600) -> dict[str, Any]:
    """Start ``world`` ranks of :func:`worker`; their figures, summarised."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        spec = json.dumps({"strategy": strategy, "dir": str(Path(tmp) / "ck"), "out": str(out)})
        port = _free_port()
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
                PYTHONPATH=os.pathsep.join([str(src), str(ROOT)]),
            )
            env.pop("SLURM_JOB_ID", None)
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", spec],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                logs.append(p.communicate()[0])
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise SystemExit(f"W={world}: ranks failed {bad}\n{logs[bad[0][0]][-3000:]}")
        ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(world)]
    cpu = sorted(r["resume_cpu_s"] for r in ranks)
    return {
        "world": world,
        "received_max": max(r["received"] for r in ranks),
        "received_rank0": ranks[0]["received"],
        "received_dcp_max": max(r["received_dcp"] for r in ranks),
        "received_own_max": max(r["received"] - r["received_dcp"] for r in ranks),
        "calls": ranks[-1]["calls"],
        "largest": max(r["largest"] for r in ranks),
        "largest_name": ranks[0]["largest_name"],
        "files": ranks[0]["files"],
        "dcp_metadata": ranks[0]["dcp_metadata"],
        "resume_cpu_max": cpu[-1],
        "resume_cpu_median": cpu[len(cpu) // 2],
        "save_s_max": max(r["save_s"] for r in ranks),
    }


def fit(worlds: list[int], values: list[float]) -> tuple[float, float]:
    """(exponent b, coefficient a) of value = a * W**b, least squares on logs."""
    xs = [math.log(w) for w in worlds]
    ys = [math.log(max(v, 1e-12)) for v in values]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return b, math.exp(my - b * mx)


def _human(value: float, unit: str) -> str:
    if unit == "B":
        for size, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value >= size:
                return f"{value / size:.3g} {name}"
        return f"{value:.0f} B"
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4,8,16,32")
    ap.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--src", default=str(ROOT / "src"), help="the src directory to measure")
    ap.add_argument("--json", default=None, help="also write every figure there")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    for w in worlds:  # one world size at a time
        t0 = time.monotonic()
        rows.append(run_world(w, args.strategy, Path(args.src)))
        r = rows[-1]
        print(
            f"W={w:3d}: received/rank/save {r['received_max']} B (rank 0 {r['received_rank0']}"
            f" B; DCP's planning {r['received_dcp_max']} B), largest file {r['largest']} B ({r['largest_name']}), {r['files']} files, "
            f"resume CPU/rank max {r['resume_cpu_max'] * 1e3:.1f} ms median "
            f"{r['resume_cpu_median'] * 1e3:.1f} ms  [{time.monotonic() - t0:.0f} s]",
            flush=True,
        )
    print(
        f"\nstrategy {args.strategy}, src {args.src}, collectives per save "
        f"(last rank): {rows[-1]['calls']}"
    )
    print(
        f"\n| cost per rank | W={' | W='.join(map(str, worlds))} | exponent | "
        f"{' | '.join(TARGETS)} |"
    )
    print("|---" * (len(worlds) + 2 + len(TARGETS)) + "|")
    fits: dict[str, Any] = {}
    for key, label, unit in (
        ("received_max", "bytes received per save", "B"),
        ("received_own_max", "of which not DCP's", "B"),
        ("largest", "largest file of a save", "B"),
        ("dcp_metadata", "DCP's .metadata (FSDP)", "B"),
        ("resume_cpu_max", "resume CPU (slowest rank)", "s"),
        ("resume_cpu_median", "resume CPU (median rank)", "s"),
    ):
        values = [r[key] for r in rows]
        b, a = fit(worlds, values)
        # A cost that does not grow (b <= 0, noise) is projected flat: its largest value.
        proj = {name: a * n**b if b > 0 else max(values) for name, n in TARGETS.items()}
        fits[key] = {"exponent": b, "coefficient": a, "projection": proj}
        cells = " | ".join(_human(v, unit) for v in values)
        print(
            f"| {label} | {cells} | {b:.2f} | "
            f"{' | '.join(_human(v, unit) for v in proj.values())} |"
        )
    print(
        "\nprojection = a * W**b, (a, b) by least squares on log W, log value; an exponent "
        "<= 0 (a cost that does not grow with W) is projected as its largest measured value"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"strategy": args.strategy, "src": args.src, "rows": rows, "fits": fits}, indent=1
            )
        )


if __name__ == "__main__":
    main()
