"""How the side channels of ``ddp.init`` scale: sockets, store requests, vote latency.

Issue 28. For each world size W (ranks are local processes, Gloo on the CPU, started as
torchrun would, ``--per-node`` ranks per simulated node), every rank runs the real
``ddp.init`` and then, for comparison, the design it replaced (``--arms mesh``: one
``new_group(backend="gloo")`` of every rank and a MAX all-reduce on it per vote).

What is counted, per rank, apart from the main backend's own cost:

- sockets: ``/proc/self/fd`` links to ``socket:`` (listening and connected), right after
  ``init_process_group`` returns and again when ``ddp.init`` returns (the tree), and
  around ``new_group`` (the mesh) and ``ddp.dist.checkpoint_group()``;
- store requests: the job's TCPStore wrapped in a counting store (:class:`Counting`),
  one count per ``set``/``get``/``add``/``wait``/``check``/... call any library makes
  through it in the same windows. Every such request is served by rank 0's store, so the
  sum over ranks is what rank 0 serves; divided by W it is "per rank". (TCPStore's own
  ``multi_get`` would fold some gets into one request: the wrapper counts them one by
  one, an upper bound.)
- vote latency: the median wall time of ``--votes`` blocking rounds (after a barrier),
  and the round's sequential hops (``2 * depth`` of the tree; ``2 (W - 1)`` for a ring).

Then a least-squares fit of log(cost) on log(W) gives each exponent, and a projection
to Aurora (10,624 nodes x 12 = 127,488 ranks) and Frontier (9,408 x 8 = 75,264): the
store part of ``ddp.init``'s added cost is (requests per rank x W) / the store's rate
(measured here with ``--store-clients`` processes hammering one libuv TCPStore), and a
vote is the tree's hops there x the time per hop measured here.

Usage: ``python bench/scale_dist.py [--worlds 2,4,8,16,32,64] [--per-node 4] [--votes 20]
[--arms tree,mesh] [--json FILE]``. One W runs at a time; 64 processes on 2 cores take
about a minute each to start.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AURORA = 127_488  # 10,624 nodes x 12 ranks
FRONTIER = 75_264  # 9,408 nodes x 8 ranks
TARGETS = (("Aurora", AURORA, 12), ("Frontier", FRONTIER, 8))
INIT_LIMIT_S = 60.0  # what ddp.init's added cost must stay under at the full machine
VOTE_LIMIT_S = 0.1  # what one vote must stay under


def sockets() -> int:
    """This process's open sockets (listening and connected), from /proc/self/fd."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _counting_store() -> Any:
    import torch.distributed as tdist

    class Counting(tdist.Store):
        """A store that counts each request this process makes through it."""

        def __init__(self, inner: tdist.Store) -> None:
            super().__init__()
            self.inner = inner
            self.calls: collections.Counter[str] = collections.Counter()

        def set(self, key, value):
            self.calls["set"] += 1
            return self.inner.set(key, value)

        def get(self, key):
            self.calls["get"] += 1
            return self.inner.get(key)

        def add(self, key, value):
            self.calls["add"] += 1
            return self.inner.add(key, value)

        def compare_set(self, key, expected, desired):
            self.calls["compare_set"] += 1
            return self.inner.compare_set(key, expected, desired)

        def wait(self, keys, timeout=None):
            self.calls["wait"] += 1
            return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def check(self, keys):
            self.calls["check"] += 1
            return self.inner.check(keys)

        def delete_key(self, key):
            self.calls["delete_key"] += 1
            return self.inner.delete_key(key)

        def num_keys(self):
            self.calls["num_keys"] += 1
            return self.inner.num_keys()

        def set_timeout(self, timeout):
            return self.inner.set_timeout(timeout)

        def total(self) -> int:
            return sum(self.calls.values())

    return Counting


def Counting(inner: Any) -> Any:
    """The job's store ``inner``, counting each request made through it (``.total()``)."""
    return _counting_store()(inner)


# ---- one rank ---------------------------------------------------------------------------
def worker(out: Path, votes: int, arms: list[str]) -> None:
    """One rank: ``ddp.init`` (the tree), then the mesh for comparison; writes rankN.json."""
    import torch
    import torch.distributed as tdist

    import ddp
    import ddp.agree
    import ddp.dist

    boxes: list[Any] = []
    real_store, real_init, real_build = (
        ddp.dist.rendezvous_store,
        tdist.init_process_group,
        ddp.agree.build,
    )
    marks: dict[str, float] = {}

    def counted_store(*args: Any, **kwargs: Any) -> Any:
        boxes.append(Counting(real_store(*args, **kwargs)))
        return boxes[-1]

    def init_pg(*args: Any, **kwargs: Any) -> None:
        real_init(*args, **kwargs)
        marks.update(sockets=sockets(), requests=boxes[0].total())

    def build(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        made = real_build(*args, **kwargs)
        marks["build_s"] = time.perf_counter() - t0
        return made

    ddp.dist.rendezvous_store, tdist.init_process_group, ddp.agree.build = (
        counted_store,
        init_pg,
        build,
    )
    ctx = ddp.init(timeout=300)
    store = boxes[0]
    agreement = ddp.dist.agreement()
    assert agreement is not None
    rec: dict[str, Any] = {
        "rank": ctx.rank,
        "tree_sockets": sockets() - marks["sockets"],
        "tree_requests": store.total() - marks["requests"],
        "tree_build_s": marks["build_s"],
        "tree_hops": agreement.hops,
        "tree_degree": len(agreement.layout.children) + (agreement.layout.parent is not None),
    }
    ddp.barrier()
    assert ddp.dist.any_rank(ctx.rank == ctx.world_size - 1)  # one rank's flag reaches all
    times = []
    for _ in range(votes):
        t0 = time.perf_counter()
        agreement.agree(False)
        times.append(time.perf_counter() - t0)
    rec["tree_vote_s"] = statistics.median(times)
    rec["tree_hops_seen"] = agreement.last_hops  # counted by the messages themselves
    rec["tree_busy_s"] = _busy_rounds(lambda: agreement.start(False), votes)
    if "mesh" in arms:
        ddp.barrier()
        s0, r0, t0 = sockets(), store.total(), time.perf_counter()
        mesh = tdist.new_group(backend="gloo")
        rec["mesh_build_s"] = time.perf_counter() - t0
        rec["mesh_sockets"], rec["mesh_requests"] = sockets() - s0, store.total() - r0
        flag = torch.zeros(1)
        ddp.barrier()
        times = []
        for _ in range(votes):
            t0 = time.perf_counter()
            tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=mesh)
            times.append(time.perf_counter() - t0)
        rec["mesh_vote_s"] = statistics.median(times)
        rec["mesh_busy_s"] = _busy_rounds(
            lambda: tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=mesh, async_op=True), votes
        )
        rec["mesh_hops"] = 2 * (ctx.world_size - 1)  # Gloo's ring all-reduce
    ddp.barrier()
    s0, r0 = sockets(), store.total()
    ddp.dist.checkpoint_group()
    rec["ckpt_sockets"], rec["ckpt_requests"] = sockets() - s0, store.total() - r0
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(rec))
    ddp.shutdown()


def _busy_rounds(start: Any, votes: int) -> float:
    """Median time from starting a round to its end while this rank's main thread runs
    Python (holding the GIL, as a training loop between torch calls does)."""
    import ddp

    times = []
    for _ in range(votes):
        ddp.barrier()
        t0, job, spin = time.perf_counter(), start(), 0
        done = getattr(job, "done", None) or job.is_completed
        while not done():
            spin += sum(range(100))
        times.append(time.perf_counter() - t0)
        job.wait() if hasattr(job, "is_completed") else job.result()
    return statistics.median(times)


# ---- the driver -------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(
    world: int, per_node: int, votes: int, arms: list[str], timeout: float
) -> list[dict[str, Any]]:
    """Start ``world`` ranks of :func:`worker`; every rank's record, in rank order."""
    local = min(per_node, world)
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank % local),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(local),
                GROUP_RANK=str(rank // local),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
            )
            env.pop("SLURM_JOB_ID", None)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        tmp,
                        "--votes",
                        str(votes),
                        "--arms",
                        ",".join(arms),
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        errors = []
        for rank, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                _, err = p.communicate()
                err += "\n[killed at the deadline]"
            if p.returncode:
                errors.append(f"rank {rank} exit {p.returncode}: {err[-1500:]}")
        if errors:
            raise SystemExit(f"W={world}: " + "\n".join(errors[:3]))
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def _store_client(port: int, requests: int, clients: int) -> None:
    """One client of :func:`store_rate`: connect, wait for all, time ``requests``."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=120))
    store.add("ready", 1)
    store.wait(["go"])
    t0 = time.time()
    for i in range(requests):
        store.get("key") if i % 2 else store.set(f"k{os.getpid()}", "x" * 64)
    print(json.dumps([t0, time.time()]))


def store_rate(clients: int, requests: int) -> float:
    """Requests per second one libuv TCPStore (as rank 0 hosts it) serves to ``clients``
    processes making ``requests`` each at once (half ``set`` of a 64-byte value, half
    ``get``: the shape of Gloo's address exchange); from the first client's start to the
    last one's end, imports excluded (the clients wait for a ``go`` key)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = _free_port()
    server = TCPStore(
        "127.0.0.1",
        port,
        1,
        True,
        timedelta(seconds=120),
        wait_for_workers=False,
        multi_tenant=True,
        use_libuv=True,
    )
    server.set("key", "x" * 64)
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import scale_dist; scale_dist._store_client({port}, {requests}, {clients})"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(clients)
    ]
    server.wait(["ready"])  # the key exists once the first client arrived
    while server.add("ready", 0) < clients:
        time.sleep(0.05)
    server.set("go", "1")
    spans = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return clients * requests / (max(b for _, b in spans) - min(a for a, _ in spans))


def fit_power(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a * x^b by least squares on log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-12)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / sum(
        (x - mx) ** 2 for x in lx
    )
    return math.exp(my - b * mx), b


def fit_log(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b * log2(x) by least squares."""
    lx = [math.log2(x) for x in xs]
    mx, my = statistics.fmean(lx), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in lx
    )
    return my - b * mx, b


def summarize(world: int, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One W's row: per-rank means and maxima, rank 0's requests per rank, medians."""
    row: dict[str, Any] = {"W": world}
    for arm in ("tree", "mesh", "ckpt"):
        if f"{arm}_sockets" not in recs[0]:
            continue
        socks = [r[f"{arm}_sockets"] for r in recs]
        row[f"{arm}_sockets_mean"] = statistics.fmean(socks)
        row[f"{arm}_sockets_max"] = max(socks)
        row[f"{arm}_requests_per_rank"] = sum(r[f"{arm}_requests"] for r in recs) / world
        if f"{arm}_vote_s" in recs[0]:
            row[f"{arm}_vote_s"] = statistics.median(r[f"{arm}_vote_s"] for r in recs)
            row[f"{arm}_busy_s"] = statistics.median(r[f"{arm}_busy_s"] for r in recs)
            row[f"{arm}_hops"] = recs[0][f"{arm}_hops"]
        if f"{arm}_build_s" in recs[0]:
            row[f"{arm}_build_s"] = statistics.median(r[f"{arm}_build_s"] for r in recs)
    row["tree_degree_max"] = max(r["tree_degree"] for r in recs)
    row["tree_hops_seen"] = max(r["tree_hops_seen"] for r in recs)
    return row


def predicted(world: int, block: int) -> tuple[float, int, float]:
    """(mean sockets, max sockets, store requests per rank) of the tree by its arithmetic:
    a listening socket per group a rank is in and one per tree neighbour; a ``set`` per
    group membership, the block size (rank 0's ``set``, every other rank's ``get``), and
    a ``wait`` + ``get`` of the other's address at each end of each of the W - 1 edges."""
    from ddp.agree import Layout

    socks, sets = [], 0
    for rank in range(world):
        lay = Layout(rank, world, block)
        socks.append(len(lay.groups) + len(lay.children) + (lay.parent is not None))
        sets += len(lay.groups)
    return statistics.fmean(socks), max(socks), (world + sets + 4 * (world - 1)) / world


def report(rows: list[dict[str, Any]], rate: float, per_node: int) -> list[str]:
    """The table, the fits and the projections, as printed lines."""
    from ddp.agree import Layout

    lines = [
        f"ranks per simulated node: {per_node}; store rate: {rate:,.0f} requests/s "
        "(one libuv TCPStore, this machine)",
        "",
    ]
    head = (
        "W",
        "tree sockets mean/max (predicted)",
        "tree req/rank (predicted)",
        "tree hops seen/layout",
        "tree vote ms idle/busy",
        "mesh sockets",
        "mesh req/rank",
        "mesh hops",
        "mesh vote ms idle/busy",
        "ckpt sockets max",
        "ckpt req/rank",
    )
    lines.append(" | ".join(head))
    nan = float("nan")
    for r in rows:
        mean, most, req = predicted(r["W"], min(per_node, r["W"]))
        lines.append(
            " | ".join(
                [
                    str(r["W"]),
                    f"{r['tree_sockets_mean']:.2f}/{r['tree_sockets_max']} ({mean:.2f}/{most})",
                    f"{r['tree_requests_per_rank']:.2f} ({req:.2f})",
                    f"{r['tree_hops_seen']}/{r['tree_hops']}",
                    f"{r['tree_vote_s'] * 1e3:.2f}/{r['tree_busy_s'] * 1e3:.1f}",
                    f"{r.get('mesh_sockets_mean', float('nan')):.1f}",
                    f"{r.get('mesh_requests_per_rank', float('nan')):.1f}",
                    str(r.get("mesh_hops", "-")),
                    f"{r.get('mesh_vote_s', nan) * 1e3:.2f}/{r.get('mesh_busy_s', nan) * 1e3:.1f}",
                    str(r["ckpt_sockets_max"]),
                    f"{r['ckpt_requests_per_rank']:.2f}",
                ]
            )
        )
    ws = [r["W"] for r in rows]
    big = [r for r in rows if r["W"] >= 4]
    big = big if len(big) >= 2 else rows
    bw = [r["W"] for r in big]
    lines += [
        "",
        f"fitted exponents (log-log least squares; W = {ws[0]}..{ws[-1]} and "
        f"{bw[0]}..{bw[-1]}; done-when: <= 0.1 for the tree's):",
    ]
    for key in (
        "tree_sockets_mean",
        "tree_sockets_max",
        "tree_requests_per_rank",
        "ckpt_sockets_max",
        "ckpt_requests_per_rank",
        "mesh_sockets_mean",
        "mesh_requests_per_rank",
    ):
        if key in rows[0]:
            every = fit_power(ws, [r[key] for r in rows])[1]
            late = fit_power(bw, [r[key] for r in big])[1]
            lines.append(f"  {key}: {every:.3f} ({late:.3f} from W = {bw[0]})")
    a, b = fit_log(bw, [r["tree_hops_seen"] for r in big])
    lines.append(
        f"  tree vote hops = {a:.2f} + {b:.2f} x log2 W (W = {bw[0]}..{bw[-1]}; "
        "a power law's exponent "
        f"{fit_power(bw, [r['tree_hops_seen'] for r in big])[1]:.3f})"
    )
    ta, tb = fit_log(bw, [r["tree_vote_s"] for r in big])
    lines.append(
        f"  tree vote time: exponent {fit_power(bw, [r['tree_vote_s'] for r in big])[1]:.3f}"
        f"; {ta * 1e3:.2f} ms + {tb * 1e3:.3f} ms x log2 W (time here is W processes "
        "taking turns on the cores: every round must run each of them once)"
    )
    if "mesh_vote_s" in big[0]:
        lines.append(
            f"  mesh vote time: exponent {fit_power(bw, [r['mesh_vote_s'] for r in big])[1]:.3f}"
        )
    worst = max(big, key=lambda r: r["tree_vote_s"] / r["tree_hops_seen"])
    per_hop = worst["tree_vote_s"] / worst["tree_hops_seen"]
    best = min(rows, key=lambda r: r["tree_vote_s"] / r["tree_hops_seen"])
    calm = best["tree_vote_s"] / best["tree_hops_seen"]
    build0 = min(r["tree_build_s"] for r in rows)
    lines += ["", "projection (exact counts by the layout, validated above; times measured here):"]
    for name, world, ppn in TARGETS:
        lay = Layout(0, world, ppn)
        mean, most, req = predicted(world, ppn)
        store_s = req * world / rate
        vote_s = lay.hops * per_hop
        init_s = store_s + build0 + vote_s
        lines.append(
            f"  {name} W={world:,} ({ppn}/node): sockets per rank mean {mean:.2f}, max "
            f"{most}; store requests {req:.2f} per rank"
        )
        lines.append(
            f"    vote = {lay.hops} hops x {per_hop * 1e3:.2f} ms/hop (worst here, W="
            f"{worst['W']}) = {vote_s:.3f} s; x {calm * 1e3:.3f} ms/hop (best here, W="
            f"{best['W']}) = {lay.hops * calm:.4f} s (limit {VOTE_LIMIT_S} s)"
        )
        lines.append(
            f"    ddp.init added = {req:.2f} x {world:,} / {rate:,.0f} req/s = {store_s:.1f} s "
            f"at rank 0's store + {build0:.3f} s local + one round {vote_s:.3f} s = "
            f"{init_s:.1f} s (limit {INIT_LIMIT_S:.0f} s)"
        )
        if "mesh_requests_per_rank" in rows[-1]:
            mreq = fit_power(ws, [r["mesh_requests_per_rank"] for r in rows])
            mesh_s = mreq[0] * world ** mreq[1] * world / rate
            lines.append(
                f"    the replaced mesh: {world:,} sockets per rank, "
                f"{mesh_s:,.0f} s at rank 0's store, a vote of {2 * (world - 1):,} "
                "hops"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4,8,16,32,64")
    ap.add_argument("--per-node", type=int, default=4)
    ap.add_argument("--votes", type=int, default=20)
    ap.add_argument("--arms", default="tree,mesh")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per world size")
    ap.add_argument("--store-clients", type=int, default=8)
    ap.add_argument("--store-requests", type=int, default=2000)
    ap.add_argument("--json", help="write the rows and the store rate here")
    ap.add_argument("--report", help="print the report of a --json file again, run nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if args.worker:
        worker(Path(args.worker), args.votes, arms)
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print("\n".join(report(saved["rows"], saved["store_rate"], saved["per_node"])))
        return 0
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        t0 = time.monotonic()
        rows.append(
            summarize(world, run_world(world, args.per_node, args.votes, arms, args.timeout))
        )
        print(f"W={world}: {json.dumps(rows[-1])} ({time.monotonic() - t0:.0f} s)", flush=True)
    rate = store_rate(args.store_clients, args.store_requests)
    print("\n".join(report(rows, rate, args.per_node)))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "store_rate": rate, "per_node": args.per_node}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
