#!/usr/bin/env python3
"""Every scale cost of docs/performance.md's "Scale" section in one command (issue 28, item 5).

The costs live in three benchmarks, one per side of the project, because each needs its
own kind of run: ``scale_dist.py`` starts W real ranks (``ddp.init``'s sockets and store
requests, the vote's hops and time), ``scale_ckpt.py`` saves and resumes a checkpoint at
each W (bytes per rank, largest file, resume CPU), and ``scale_login.py`` runs the login
side against 1 to 10,000 records and jobs (scheduler calls, records read, qstat memory).
This driver runs them one after the other with the same sizes docs/performance.md quotes (or
small ones with ``--quick``), keeps each one's JSON, and ends with one table: each
cost, its fitted exponent and the limit it must stay under.

Usage: python bench/scale.py [--quick] [--out DIR] [--summary]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_dist import fit_power

HERE = Path(__file__).resolve().parent

#: (benchmark, arguments for docs/performance.md's figures, arguments for --quick)
PARTS = (
    ("scale_dist.py", ["--worlds", "2,4,8,16,32,64"], ["--worlds", "2,4,8", "--votes", "5"]),
    ("scale_ckpt.py", ["--worlds", "2,4,8,16,32"], ["--worlds", "2,4"]),
    (
        "scale_login.py",
        ["--sizes", "1,10,100,1000,10000"],
        ["--sizes", "1,10,100", "--jobs", "1000", "--old-max", "100"],
    ),
)


#: The costs docs/performance.md's table states, by benchmark: (name, how to take (sizes, values)
#: from its JSON, the limit on the fitted exponent).
COSTS = {
    "scale_dist": [
        ("extra sockets per rank, mean", lambda d: _rows(d, "tree_sockets_mean"), 0.1),
        ("rank 0's store requests per rank", lambda d: _rows(d, "tree_requests_per_rank"), 0.1),
        ("background-save group: sockets per rank", lambda d: _rows(d, "ckpt_sockets_max"), 0.1),
    ],
    "scale_ckpt": [
        ("checkpoint bytes received per rank per save", lambda d: _rows(d, "received_max"), 0.0),
    ],
    "scale_login": [
        (
            "hpc status of an N-task sweep: SLURM calls",
            lambda d: (d["sizes"], d["status"]["slurm"]["now"]),
            0.0,
        ),
        (
            "hpc status of an N-task sweep: PBS calls",
            lambda d: (d["sizes"], d["status"]["pbs"]["now"]),
            0.0,
        ),
        ("job-id lookup: records read on a hit", lambda d: (d["sizes"], d["lookup"]["hit"]), 0.0),
        (
            "qstat reader peak MB, 1 job asked for",
            lambda d: (d["jobs"], d["qstat"]["stream_mb"]),
            0.1,
        ),
    ],
}


def _rows(data: dict, key: str) -> tuple[list[float], list[float]]:
    """(W, value) pairs of a per-world benchmark's rows."""
    rows = [r for r in data["rows"] if r.get(key) is not None]
    return [r.get("W", r.get("world")) for r in rows], [r[key] for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a check, not figures")
    ap.add_argument("--out", help="keep each benchmark's JSON here (default: a temp dir)")
    ap.add_argument(
        "--summary",
        action="store_true",
        help="run nothing: print the table of the JSON already in --out",
    )
    args = ap.parse_args()
    if args.summary and not args.out:
        ap.error("--summary reads the JSON of an earlier run: name its --out")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hpc-ddp-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for script, full, quick in () if args.summary else PARTS:
        target = out / (Path(script).stem + ".json")
        cmd = [
            sys.executable,
            str(HERE / script),
            *(quick if args.quick else full),
            "--json",
            str(target),
        ]
        print(f"== {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(script)
    print("\n| cost | sizes | values | exponent | limit |\n|---|---|---|---|---|")
    for stem, costs in COSTS.items():
        target = out / f"{stem}.json"
        if not target.is_file():
            continue
        data = json.loads(target.read_text())
        for name, take, limit in costs:
            try:
                sizes, values = take(data)
            except (KeyError, TypeError):
                print(f"| {name} | (not in {target.name}) | | | |")
                continue
            exp = fit_power(sizes, values)[1] if len(sizes) > 1 and min(values) > 0 else 0.0
            ok = "ok" if exp <= limit + 1e-9 else "OVER"
            print(
                f"| {name} | {sizes[0]:g}..{sizes[-1]:g} | {values[0]:g}..{values[-1]:g} "
                f"| {exp:.3f} | <= {limit:g} {ok} |"
            )
    print(f"JSON in {out}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
