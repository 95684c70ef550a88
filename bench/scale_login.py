#!/usr/bin/env python3
"""The login side at scale: what ``hpc status``, ``hpc logs`` and the qstat reader cost
as runs, tasks and jobs grow from 1 to 10,000 (issue 28, item 4; its item 5 measures).

Four counts, each with its fitted exponent (slope of log cost over log size; 0 is flat,
1 is linear) and, where the design before this issue is still runnable, the same count
for it in the same run:

1. scheduler calls for ``hpc status`` of an N-task sweep (SLURM and PBS), counted by
   fake clients on PATH that log each call and answer like the real ones
   (``squeue -r -j``, ``qstat -x -f -F json -t``). "per id" is the interface's
   one-call-per-id default (what hpc did before: N+1 calls). Goal: at most 2, flat.
2. run records read for a job-id lookup among N runs (``hpc status ID``, ``hpc logs
   ID``), counted by wrapping the one reader of run files: the lookup that builds the
   index (once), then a hit, a hit in another spelling of the PBS server, and a miss.
   Goal: O(1) records after the index exists.
3. peak memory (tracemalloc) of the qstat reader over ``qstat -x -f -F json`` of J jobs
   (1k, 10k, 50k; synthetic, ~2 KB a job as a real server's) with 1 job asked for:
   streamed from the file and keeping the one job, vs the whole answer parsed (as
   before). Goal: flat in J.
4. looking up N subjobs asked as ``123[i].host.domain`` in an answer that spells the
   server ``host``: entries examined, by key (one access) vs the per-id scan before
   (N a lookup). Goal: N lookups cost O(N), not O(N^2).

Usage: python bench/scale_login.py [--sizes 1,10,100,1000,10000] [--jobs 1000,10000,50000]
       [--old-max 1000] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import stat
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from hpc import core, runs, schedulers  # noqa: E402
from hpc.schedulers import _pbs_qstat, pbs  # noqa: E402

SQUEUE = r"""#!/bin/bash
echo "squeue $*" >> "$BENCH_LOG"
ids="$6"  # squeue -h -r -t all -j LIST -o FMT
for id in ${ids//,/ }; do
  if [[ $id == *_* ]]; then echo "$id|${id%%_*}|PENDING"
  else for ((i = 0; i < BENCH_TASKS; i++)); do echo "${id}_$i|$id|PENDING"; done; fi
done
"""
QSTAT = r"""#!/usr/bin/env -S python3 -S
import json, os, re, sys
with open(os.environ["BENCH_LOG"], "a") as fh:
    fh.write("qstat " + " ".join(sys.argv[1:]) + "\n")
n = int(os.environ["BENCH_TASKS"])
jobs = {}
for arg in sys.argv[1:]:
    m = re.fullmatch(r"([0-9]+)\[([0-9]*)\](\..*)", arg)
    if not m:
        continue
    if m.group(2):
        jobs[arg] = {"job_state": "Q", "array_index": m.group(2)}
    else:
        jobs[arg] = {"job_state": "B"}
        for i in range(n):
            jobs[f"{m.group(1)}[{i}]{m.group(3)}"] = {"job_state": "Q", "array_index": str(i)}
print(json.dumps({"pbs_version": "23.06", "Jobs": jobs}, indent=4))
"""


def exponent(sizes: list[int], values: list[float]) -> float | None:
    """Least-squares slope of log(value) over log(size), points with value > 0."""
    pts = [(math.log(s), math.log(v)) for s, v in zip(sizes, values, strict=True) if v and v > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


@contextlib.contextmanager
def fake_clients(where: Path) -> Iterator[Path]:
    """squeue and qstat fakes first on PATH; yields their call log."""
    where.mkdir(parents=True, exist_ok=True)
    for name, text in (("squeue", SQUEUE), ("qstat", QSTAT)):
        path = where / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    log = where / "calls.log"
    old = dict(os.environ)
    os.environ.update(PATH=f"{where}{os.pathsep}{old.get('PATH', '')}", BENCH_LOG=str(log))
    try:
        yield log
    finally:
        os.environ.clear()
        os.environ.update(old)


def calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def sweep_run(runs_dir: Path, scheduler: str, job_id: str, n: int) -> Path:
    run = runs_dir / f"sweep-{scheduler}-{n}"
    run.mkdir(parents=True)
    runs.write_record(
        run,
        {
            "name": "sweep",
            "scheduler": scheduler,
            "cluster": scheduler,
            "job_id": job_id,
            "sweep": [{"index": i, "label": f"x={i}", "dir": f"t{i}"} for i in range(n)],
        },
    )
    return run


def bench_status(sizes: list[int], old_max: int, tmp: Path) -> dict[str, Any]:
    """1. scheduler calls for ``hpc status`` of an N-task sweep."""
    out: dict[str, Any] = {}
    with fake_clients(tmp / "bin") as log:
        for name, job_id in (("slurm", "4242"), ("pbs", "77[].srv")):
            now, before = [], []
            for n in sizes:
                os.environ["BENCH_TASKS"] = str(n)
                runs_dir = tmp / f"status-{name}-{n}"
                run = sweep_run(runs_dir, name, job_id, n)
                start = calls(log)
                _, state, tasks = core.run_status(str(run), runs_dir)
                assert len(tasks) == n and all(t[2] == "PENDING" for t in tasks), (name, n)
                now.append(calls(log) - start)
                if n <= old_max:  # the interface's default: one call per id
                    sched = schedulers.get(name)
                    ids = [job_id, *(sched.task_id(job_id, i) for i in range(n))]
                    start = calls(log)
                    schedulers.Scheduler.statuses(sched, ids)
                    before.append(calls(log) - start)
                else:
                    before.append(None)
            out[name] = {"now": now, "per_id": before}
    return out


def many_runs(runs_dir: Path, n: int) -> None:
    runs_dir.mkdir(parents=True)
    for i in range(n):
        run = runs_dir / f"job-{i:06d}"
        run.mkdir()
        rec = {
            "name": "job",
            "scheduler": "pbs",
            "cluster": "aurora",
            "job_id": f"{1_000_000 + i}.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov",
        }
        (run / "run.json").write_text(json.dumps(rec))


def _old_find(ident: str, runs_dir: Path) -> Path | None:
    """The job-id lookup before issue 28 (kept here as the baseline): every record, the
    newest name first, until one holds the id; that one read again to check it."""
    for rec_path in sorted(runs_dir.glob(f"*/{runs.RECORD}"), reverse=True):
        rec = json.loads(runs.read_regular(rec_path, "run"))
        job_id = str(rec.get("job_id") or "")
        if job_id and (job_id == ident or job_id.split(".")[0] == ident):
            runs.read_record(rec_path.parent)
            return rec_path.parent
    return None


def bench_lookup(sizes: list[int], tmp: Path) -> dict[str, Any]:
    """2. records read (and seconds) per job-id lookup among N runs."""
    opened: list[str] = []
    real = runs.read_regular

    def counting(path: Path, *a: Any, **k: Any) -> bytes:
        if Path(path).name == runs.RECORD:
            opened.append(str(path))
        return real(path, *a, **k)

    runs.read_regular = counting  # type: ignore[assignment]
    out: dict[str, list[float]] = {
        k: [] for k in ("build", "hit", "other_server", "miss", "hit_s", "scan", "scan_s")
    }
    try:
        for n in sizes:
            runs_dir = tmp / f"lookup-{n}"
            many_runs(runs_dir, n)
            del opened[:]
            assert runs.find(str(1_000_000 + n // 2), runs_dir) is not None
            out["build"].append(len(opened))
            samples = []
            for key, ident in (
                ("hit", f"{1_000_000 + n - 1}.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"),
                ("other_server", f"{1_000_000 + n // 3}.aurora-pbs-0001"),
                ("miss", "999"),
            ):
                del opened[:]
                start = time.perf_counter()
                found = runs.find(ident, runs_dir)
                samples.append(time.perf_counter() - start)
                assert (found is None) == (key == "miss"), (key, n)
                out[key].append(len(opened))
            out["hit_s"].append(samples[0])
            del opened[:]
            start = time.perf_counter()
            assert _old_find(str(1_000_000 + n // 2), runs_dir) is not None
            out["scan_s"].append(time.perf_counter() - start)
            out["scan"].append(len(opened))
    finally:
        runs.read_regular = real  # type: ignore[assignment]
    return out


def qstat_file(path: Path, jobs: int) -> Path:
    """A ``qstat -x -f -F json`` answer of ``jobs`` finished jobs, ~2 KB each."""
    variables = {f"PBS_O_VAR{i}": "/lus/flare/projects/x/" + "y" * 40 for i in range(20)}
    with path.open("w") as fh:
        fh.write(
            '{\n    "timestamp":1795475428,\n    "pbs_version":"23.06.06",\n'
            '    "pbs_server":"aurora-pbs-0001",\n    "Jobs":{\n'
        )
        for i in range(jobs):
            attrs = {
                "Job_Name": f"job{i}",
                "Job_Owner": "user@aurora-uan-0009",
                "job_state": "F",
                "queue": "prod",
                "substate": 92,
                "Exit_status": 0,
                "Resource_List": {"select": "256:system=aurora", "walltime": "01:00:00"},
                "Variable_List": variables,
                "comment": "Job run at ... and finished",
            }
            sep = "," if i < jobs - 1 else ""
            fh.write(f'        "{i}.aurora-pbs-0001":{json.dumps(attrs, indent=4)}{sep}\n')
        fh.write("    }\n}\n")
    return path


def peak_mb(fn: Any) -> tuple[float, Any]:
    tracemalloc.start()
    try:
        result = fn()
        return tracemalloc.get_traced_memory()[1] / 2**20, result
    finally:
        tracemalloc.stop()


def bench_qstat(job_counts: list[int], tmp: Path) -> dict[str, Any]:
    """3. peak memory of the qstat reader, one job asked for."""
    out: dict[str, list[float]] = {"stream_mb": [], "whole_mb": [], "file_mb": []}
    for jobs in job_counts:
        path = qstat_file(tmp / f"qstat-{jobs}.json", jobs)
        want = [f"{jobs // 2}.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov"]

        def streamed(path: Path = path, want: list[str] = want) -> Any:
            with path.open("rb") as fh:
                return pbs.read_qstat_json(fh, want)

        mb, info = peak_mb(streamed)
        assert pbs.lookup(info, want[0]) is not None and len(info) == 1
        out["stream_mb"].append(mb)
        mb, info = peak_mb(lambda path=path: _old_read(path.read_text()))
        assert len(info) == jobs  # every job kept: the reader before this issue
        out["whole_mb"].append(mb)
        out["file_mb"].append(path.stat().st_size / 2**20)
        path.unlink()
    return out


def _old_read(text: str) -> dict[str, Any]:
    """The qstat JSON reader before issue 28 (kept here as the baseline): the whole
    answer parsed, every job kept."""
    jobs = pbs.loads_qstat_json(text).get("Jobs") or {}
    out = {}
    for pbs_id, attrs in jobs.items():
        info = _pbs_qstat._info(str(pbs_id), attrs)
        out[str(pbs_id)] = info
        out[pbs.submitit_id(str(pbs_id), attrs)] = info
    return out


def _old_lookup(info: dict[str, Any], job_id: str, examined: list[int]) -> Any:
    """The lookup before issue 28 (kept here as the baseline): exact, else a scan of
    every entry comparing sequence number and array index."""

    def seq(j: str) -> str:
        m = re.match(r"^[0-9]+", j)
        return m.group(0) if m else j

    def index(j: str) -> str | None:
        m = re.match(r"^[0-9]+\[([0-9]+)\]", j)
        return m.group(1) if m else None

    if job_id in info:
        return info[job_id]
    for key, value in info.items():
        examined[0] += 1
        if seq(key) == seq(job_id) and index(key) == index(job_id):
            return value
    return None


def bench_spelling(sizes: list[int], old_max: int) -> dict[str, Any]:
    """4. entries examined (and seconds) looking up all N subjobs in another spelling."""
    out: dict[str, list[float | None]] = {"key_s": [], "scan_examined": [], "scan_s": []}
    for n in sizes:
        jobs = {f"5[{i}].host": {"job_state": "R"} for i in range(n)}
        info = pbs.read_qstat_json(json.dumps({"Jobs": jobs}))
        asked = [f"5[{i}].host.domain.example" for i in range(n)]
        start = time.perf_counter()
        assert all(pbs.lookup(info, j) is not None for j in asked)
        out["key_s"].append(time.perf_counter() - start)
        if n <= old_max:
            examined = [0]
            start = time.perf_counter()
            assert all(_old_lookup(info, j, examined) is not None for j in asked)
            out["scan_s"].append(time.perf_counter() - start)
            out["scan_examined"].append(examined[0])
        else:
            out["scan_s"].append(None)
            out["scan_examined"].append(None)
    return out


def row(name: str, values: list[Any], sizes: list[int], fmt: str = "{:g}", goal: str = "") -> str:
    cells = ["n/m" if v is None else fmt.format(v) for v in values]
    measured = [(s, v) for s, v in zip(sizes, values, strict=True) if v is not None]
    exp = exponent([s for s, _ in measured], [v for _, v in measured])
    exp_s = "-" if exp is None else f"{exp:+.2f}"
    return f"| {name} | " + " | ".join(cells) + f" | {exp_s} | {goal} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,10,100,1000,10000")
    parser.add_argument("--jobs", default="1000,10000,50000")
    parser.add_argument(
        "--old-max",
        type=int,
        default=1000,
        help="largest size the designs before issue 28 are run at",
    )
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    job_counts = [int(s) for s in args.jobs.split(",")]
    results: dict[str, Any] = {"sizes": sizes, "jobs": job_counts}
    with tempfile.TemporaryDirectory(prefix="scale-login-") as tmp:
        results["status"] = bench_status(sizes, args.old_max, Path(tmp))
        results["lookup"] = bench_lookup(sizes, Path(tmp))
        results["qstat"] = bench_qstat(job_counts, Path(tmp))
    results["spelling"] = bench_spelling(sizes, args.old_max)

    head = "| cost | " + " | ".join(f"N={s:,}" for s in sizes) + " | exponent | goal |"
    rule = "|" + "---|" * (len(sizes) + 3)
    st, lk, sp = results["status"], results["lookup"], results["spelling"]
    lines = [
        head,
        rule,
        row(
            "hpc status of an N-task sweep: SLURM calls",
            st["slurm"]["now"],
            sizes,
            goal="<= 2, flat",
        ),
        row("  same, one call per id (before)", st["slurm"]["per_id"], sizes),
        row("hpc status of an N-task sweep: PBS calls", st["pbs"]["now"], sizes, goal="<= 2, flat"),
        row("  same, one call per id (before)", st["pbs"]["per_id"], sizes),
        row(
            "job-id lookup among N runs: records read, first (builds the index)", lk["build"], sizes
        ),
        row("  records read, hit", lk["hit"], sizes, goal="O(1)"),
        row(
            "  records read, hit in another server spelling", lk["other_server"], sizes, goal="O(1)"
        ),
        row("  records read, miss", lk["miss"], sizes, goal="O(1)"),
        row("  seconds, hit", lk["hit_s"], sizes, fmt="{:.4f}"),
        row("  records read, a hit mid-way by the scan (before)", lk["scan"], sizes),
        row("  seconds, same (before)", lk["scan_s"], sizes, fmt="{:.4f}"),
        row(
            "N subjobs looked up, other server spelling: seconds by key",
            sp["key_s"],
            sizes,
            fmt="{:.4f}",
            goal="exponent <= 1",
        ),
        row("  entries examined by the scan (before)", sp["scan_examined"], sizes),
        row("  seconds by the scan (before)", sp["scan_s"], sizes, fmt="{:.3f}"),
    ]
    q = results["qstat"]
    qhead = "| qstat reader, 1 job asked for | " + " | ".join(f"J={j:,}" for j in job_counts)
    lines += [
        "",
        qhead + " | exponent | goal |",
        "|" + "---|" * (len(job_counts) + 3),
        row("answer size, MB", q["file_mb"], job_counts, fmt="{:.1f}"),
        row(
            "peak MB, streamed (now)",
            q["stream_mb"],
            job_counts,
            fmt="{:.2f}",
            goal="flat (exponent ~0)",
        ),
        row("peak MB, whole answer parsed (before)", q["whole_mb"], job_counts, fmt="{:.1f}"),
    ]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
