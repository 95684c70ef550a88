"""How long a job takes to get back to training after losing a node (issue 30, Benchmark).

``python bench/recovery.py [--rounds 3] [--hang-timeout-s 10] [--out bench/results/recovery.json]``

Runs on the real SLURM test cluster (tests/support/slurm.py: munge, slurmctld and two
slurmd, nodes n1/n2 on this host) a small 2-node Trainer job (one rank per node, Gloo,
checkpoint every 2 steps) four times:

* ``baseline``: no fault, under the supervisor: the job's wall time without a failure;
* ``kill_supervised``: ``#SBATCH --no-kill`` and ``python -m ddp.supervise -- srun ...``;
  n2's rank is SIGKILLed before step 5; the supervisor excludes n2 and relaunches on n1;
* ``kill_resubmit``: the same kill without the supervisor (``srun --kill-on-bad-exit=1``):
  the job ends FAILED and is resubmitted at once with ``sbatch`` (the best case of a
  resubmit: an automated one into an empty queue), resuming from the same checkpoint;
* ``hang_supervised``: n2's rank is SIGSTOPped instead: hang_timeout_s, the stacks, the
  relaunch.

Each recovery is split from timestamps, all on this host's clock (epoch seconds):
the fault (this script, at the signal), the supervisor's ``failure`` and ``restart``
events in ``run.json`` (their ``t``), and each rank's own timeline (this script as the
worker, ``--worker``): process start, checkpoint load start and end, first step.

* detection = failure event - fault (resubmit path: the job seen ended by ``scontrol``);
  for a hang also seen (the supervisor's ``seen_t``: no beat for hang_timeout_s) - fault,
  and stacks + kill = failure event - seen (every rank's stack, the probe on n2, the kills);
* relaunch = first rank's checkpoint load start in the next attempt - failure event
  (srun's step launch, Python and torch imports, ``ddp.init``'s rendezvous);
* load = load end - load start (``Checkpointer.load`` + ``restore_model``);
* to first step = first step after resume - load end (loader, optimizer state);
* total = first step after resume - fault;
* wall lost = the job's submit-to-end time - the baseline's (resubmit path: from the
  first submit to the second job's end).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
N, BATCH, HOLD_STEP = 96, 4, 4  # 12 steps per rank at world 2; n2's rank stops before step 5


# ---- the worker: one rank, writing its timeline -------------------------------------------
def worker(spec: dict[str, Any]) -> None:
    """One rank of the job (run by srun): a tiny Trainer run that writes
    ``timeline/JOB.STEP.RANK.jsonl`` (process start, load start/end, first step) and, on
    n2's rank in the first attempt, ``hold/ready`` (its pid) before step ``HOLD_STEP + 1``,
    where it then waits for good (a stopped rank continued for its stack stays stuck)."""
    t0 = time.time()
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    name = f"{os.environ.get('SLURM_JOB_ID', '0')}.{os.environ.get('SLURM_STEP_ID', '0')}.{rank}"
    tl = open(Path(spec["dir"]) / "timeline" / f"{name}.jsonl", "a")

    def mark(event: str, **kw: Any) -> None:
        tl.write(json.dumps({"event": event, "t": time.time(), **kw}) + "\n")
        tl.flush()

    mark("start", t=t0, node=os.environ.get("SLURMD_NODENAME", ""))
    import torch
    from torch import nn

    import ddp
    from ddp.checkpoint.manager import Checkpointer
    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    real_load, real_restore = Checkpointer.load, Checkpointer.restore_model

    def load(self: Checkpointer) -> Any:
        mark("load_start")
        state = real_load(self)
        if state is None:
            mark("load_end", step=None)
        return state

    def restore(self: Checkpointer, state: dict[str, Any], model: nn.Module) -> None:
        real_restore(self, state, model)
        mark("load_end", step=int(state["global_step"]))

    real_loop = Checkpointer.restore_loop

    def restore_loop(self: Checkpointer, *a: Any, **kw: Any) -> Any:
        mark("loop_start")
        got = real_loop(self, *a, **kw)
        mark("loop_end")
        return got

    Checkpointer.load, Checkpointer.restore_model = load, restore  # type: ignore[method-assign]
    Checkpointer.restore_loop = restore_loop  # type: ignore[method-assign]
    hold = Path(spec["dir"]) / "hold"
    first = [True]
    trainer: Trainer

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if first[0]:
            first[0] = False
            mark("first_step", step=trainer.global_step + 1)
        if (
            spec.get("fault")
            and rank == 1
            and trainer.global_step == HOLD_STEP
            and not (hold / "ready").exists()
        ):  # the first attempt only
            (hold / "ready.tmp").write_text(str(os.getpid()))
            os.replace(hold / "ready.tmp", hold / "ready")
            deadline = time.monotonic() + 300  # only against a bench that never acts
            while time.monotonic() < deadline:  # a true hang: it never goes on by itself
                time.sleep(0.01)  # the bench kills or stops this rank here
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    cfg = TrainConfig.from_dict(
        {
            "training": {"batch_size": BATCH, "epochs": 1, "shuffle": True, "seed": 3},
            "optim": {"name": "sgd", "lr": 0.01},
            "checkpoint": {
                "dir": str(Path(spec["dir"]) / "ckpt"),
                "every_n_steps": 2,
                "save_final": False,
            },
            "logging": {"every_n_steps": 4, "progress": "off"},
        }
    )
    trainer = Trainer(model, data, cfg, step)
    trainer.fit()
    mark("end", step=trainer.global_step)
    ddp.shutdown()


# ---- the bench: one case on the cluster ---------------------------------------------------
def _script(
    case_dir: Path, spec: dict[str, Any], supervised: bool, hang_timeout_s: float, port: int
) -> Path:
    run = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    srun = f"srun --kill-on-bad-exit=1 {shlex.join(run)}"
    line = (
        f"{sys.executable} -m ddp.supervise --run-dir {case_dir / 'run'} "
        f"--hang-timeout-s {hang_timeout_s:g} --max-restarts 2 --min-nodes 1 -- {srun}"
        if supervised
        else srun
    )
    path = case_dir / "job.sh"
    path.write_text(
        "\n".join(
            [
                "#!/bin/bash",
                "#SBATCH -N 2",
                "#SBATCH --ntasks-per-node=1",
                *(["#SBATCH --no-kill"] if supervised else []),
                "set -eu",
                f"export PYTHONPATH={ROOT / 'src'}:{ROOT} OMP_NUM_THREADS=1 MASTER_PORT={port}",
                line,
            ]
        )
        + "\n"
    )
    return path


def _wait(what: str, check: Any, timeout: float, cluster: Any, job: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(
                f"bench: {what} not after {timeout:g} s\n{cluster.job_log(job)[-3000:]}"
            )
        time.sleep(0.02)


def _ended(cluster: Any, job: str) -> str | None:
    from tests.support.slurm import ENDED_STATES

    state = cluster.state(job)
    return state if state in ENDED_STATES else None


def _timelines(case_dir: Path) -> list[list[dict[str, Any]]]:
    """Each rank process's events, ordered by their start."""
    out = []
    for f in (case_dir / "timeline").glob("*.jsonl"):
        out.append([json.loads(x) for x in f.read_text().splitlines() if x.strip()])
    return sorted(out, key=lambda evs: evs[0]["t"])


def run_case(
    cluster: Any, base: Path, name: str, fault: str | None, supervised: bool, hang_timeout_s: float
) -> dict[str, Any]:
    from tests.support.ports import free_port

    case_dir = base / name
    for sub in ("timeline", "hold", "run"):
        (case_dir / sub).mkdir(parents=True)
    spec = {"dir": str(case_dir), "fault": fault}
    script = _script(case_dir, spec, supervised, hang_timeout_s, free_port())
    t_submit = time.time()
    job = cluster.submit(script)
    jobs, t_fault, t_dead = [job], None, None
    if fault:
        ready = case_dir / "hold" / "ready"
        _wait(
            "n2's rank at the fault step",
            lambda: ready.exists() or _ended(cluster, job),
            300,
            cluster,
            job,
        )
        pid = int(ready.read_text())
        t_fault = time.time()
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    if fault and not supervised:  # the job dies; resubmit it as soon as it is seen ended
        state = _wait("the job's end", lambda: _ended(cluster, job), 300, cluster, job)
        t_dead = time.time()
        job2 = cluster.submit(script)
        jobs.append(job2)
        print(f"bench: {name}: job {job} ended {state}; resubmitted as {job2}", file=sys.stderr)
    final = _wait("the job's end", lambda: _ended(cluster, jobs[-1]), 600, cluster, jobs[-1])
    t_end = time.time()
    if final != "COMPLETED":
        raise SystemExit(
            f"bench: {name}: job {jobs[-1]} ended {final}\n{cluster.job_log(jobs[-1])[-3000:]}"
        )
    res: dict[str, Any] = {
        "case": name,
        "jobs": jobs,
        "state": final,
        "wall_s": round(t_end - t_submit, 2),
    }
    events = []
    if supervised:
        events = json.loads((case_dir / "run" / "run.json").read_text())["supervisor"]["events"]
        res["events"] = [
            {k: e[k] for k in ("event", "t", "seen_t", "nodes", "kind") if k in e} for e in events
        ]
    if not fault:
        return res
    procs = _timelines(case_dir)
    resumed = [p for p in procs if p[0]["t"] > t_fault]
    failure = next((e for e in events if e["event"] == "failure"), {})
    t_detect = failure.get("t", t_dead)
    if "seen_t" in failure:  # a hang: seen, then every rank's stacks taken and ranks killed
        res["seen_s"] = round(failure["seen_t"] - t_fault, 2)
        res["stacks_kill_s"] = round(t_detect - failure["seen_t"], 2)
    load_start = min(e["t"] for p in resumed for e in p if e["event"] == "load_start")
    load_end = max(e["t"] for p in resumed for e in p if e["event"] == "load_end")
    first = min(e["t"] for p in resumed for e in p if e["event"] == "first_step")
    steps = {e.get("step") for p in resumed for e in p if e["event"] == "load_end"}
    res.update(
        {
            "detection_s": round(t_detect - t_fault, 2),
            "relaunch_s": round(load_start - t_detect, 2),
            "load_s": round(load_end - load_start, 2),
            "to_first_step_s": round(first - load_end, 2),
            "total_s": round(first - t_fault, 2),
            "resumed_from_step": sorted(s for s in steps if s is not None),
            "world_after": len(resumed),
            "nodes_after": sorted({p[0].get("node", "") for p in resumed}),
        }
    )
    if supervised:
        restart = next(e["t"] for e in events if e["event"] == "restart")
        res["failure_to_restart_event_s"] = round(restart - t_detect, 2)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument(
        "--hang-timeout-s",
        type=float,
        default=10.0,
        help="the supervisor's hang timeout (default 10: above a step here)",
    )
    p.add_argument("--out", default=str(ROOT / "bench/results/recovery.json"))
    p.add_argument("--rounds", type=int, default=3, help="each case this often (median shown)")
    p.add_argument("--cases", default="baseline,kill_supervised,kill_resubmit,hang_supervised")
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    os.environ["PYTHONPATH"] = f"{ROOT / 'src'}:{ROOT}"
    os.environ["PATH"] += ":/usr/local/sbin:/usr/sbin:/sbin"
    from tests.support.slurm import missing_exes, start_cluster

    if missing_exes():
        print(f"bench: SLURM programs missing: {missing_exes()}", file=sys.stderr)
        return 2
    plan = {
        "baseline": (None, True),
        "kill_supervised": ("kill", True),
        "kill_resubmit": ("kill", False),
        "hang_supervised": ("stop", True),
    }
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in plan]
    if bad:
        print(f"bench: unknown case(s) {bad}; allowed: {', '.join(plan)}", file=sys.stderr)
        return 2
    if not 1 <= args.rounds <= 20:
        print(f"bench: --rounds {args.rounds}: allowed: 1 to 20", file=sys.stderr)
        return 2
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="recovery-") as tmp, start_cluster() as cluster:
        for i in range(args.rounds):  # cases interleaved, so a load spike hits every case
            for name in cases:
                fault, supervised = plan[name]
                res = run_case(
                    cluster, Path(tmp) / str(i), name, fault, supervised, args.hang_timeout_s
                )
                res["round"] = i
                print(json.dumps(res), file=sys.stderr)
                runs.append(res)
    cols = (
        "seen_s",
        "stacks_kill_s",
        "detection_s",
        "relaunch_s",
        "load_s",
        "to_first_step_s",
        "total_s",
        "wall_s",
        "wall_lost_s",
    )
    for r in runs:  # against the same round's baseline
        base = next(
            (b["wall_s"] for b in runs if b["case"] == "baseline" and b["round"] == r["round"]),
            None,
        )
        if base is not None:
            r["wall_lost_s"] = round(r["wall_s"] - base, 2)
    results = []
    print(
        "median [min-max] of "
        + str(args.rounds)
        + " round(s), seconds\n| case | "
        + " | ".join(c[:-2] for c in cols)
        + " |\n|---|"
        + "---|" * len(cols)
    )
    for name in cases:
        mine = [r for r in runs if r["case"] == name]
        row = {"case": name}
        for c in cols:
            vals = sorted(r[c] for r in mine if c in r)
            if vals:
                row[c] = {"median": statistics.median(vals), "min": vals[0], "max": vals[-1]}
        results.append(row)
        print(
            f"| {name} | "
            + " | ".join(
                f"{row[c]['median']:.2f} [{row[c]['min']:.2f}-{row[c]['max']:.2f}]"
                if c in row
                else ""
                for c in cols
            )
            + " |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/recovery.py " + " ".join(argv or sys.argv[1:]),
        "hang_timeout_s": args.hang_timeout_s,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }
    out.write_text(json.dumps({"meta": meta, "summary": results, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
