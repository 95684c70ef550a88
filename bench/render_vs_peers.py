"""How long does producing a 2-node x 4-GPU SLURM script take, against the peers?

Question: is ``hpc render`` cheaper than TorchX's ``--dryrun`` and submitit's script
builder, whole process included (what a user waits for on a login node)?

Runs, interleaved round by round so that machine load hits every command alike:

- floor:    ``python -c pass``
- hpc:      ``python -m hpc render --cluster perlmutter --nodes 2 -- python train.py``
            (account from $SBATCH_ACCOUNT, as a user would have it)
- torchx:   ``torchx run --dryrun -s slurm dist.ddp -j 2x4 --gpu 4 --script train.py``
- submitit: ``SlurmExecutor(...).update_parameters(nodes=2, ntasks_per_node=4,
            gpus_per_node=4)`` then its private ``_make_submission_file_text`` (it has no
            public dry run)

A peer that is not installed is skipped with a note. Prints the median wall time of
each and the ratios hpc/peer (targets: <= 0.5 x torchx, <= 1.0 x submitit).

``--teardown`` adds two diagnostic arms, hpc and submitit each ending in ``os._exit``
(no interpreter teardown: what the old ``os._exit`` in ``hpc`` bought), to show how
much of each whole-process time is the interpreter's cleanup of what was imported.
They are not what a user runs, and the ratios are always of the two real commands.

``--syscalls`` also counts each command's file-system system calls once, under
``strace -c`` (open, stat, read, getdents...): on a login node whose Python lives on
a shared file system (Lustre, GPFS) each of them is a metadata round trip, a cost
this machine's local disk hides.

    python bench/render_vs_peers.py [--rounds 21] [--teardown] [--syscalls]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBMITIT = (
    "from submitit import SlurmExecutor\n"
    "e = SlurmExecutor(folder='submitit-logs')\n"
    "e.update_parameters(nodes=2, ntasks_per_node=4, gpus_per_node=4)\n"
    "print(e._make_submission_file_text('python train.py', 'uid'))\n"
)


HPC_NO_TEARDOWN = (
    "import os, sys\n"
    "from hpc.cli import main\n"
    "code = main()\n"
    "sys.stdout.flush()\n"
    "os._exit(code or 0)\n"
)


def commands(teardown: bool = False) -> tuple[dict[str, list[str]], list[str]]:
    """The commands to time, and notes on peers left out."""
    py = sys.executable
    cmds = {
        "floor": [py, "-c", "pass"],
        "hpc": [
            py,
            "-m",
            "hpc",
            "render",
            "--cluster",
            "perlmutter",
            "--nodes",
            "2",
            "--",
            "python",
            "train.py",
        ],
    }
    if teardown:
        cmds["hpc-x"] = [py, "-c", HPC_NO_TEARDOWN, *cmds["hpc"][3:]]
    notes = []
    torchx = shutil.which("torchx")
    if torchx:
        cmds["torchx"] = [
            torchx,
            "run",
            "--dryrun",
            "-s",
            "slurm",
            "dist.ddp",
            "-j",
            "2x4",
            "--gpu",
            "4",
            "--script",
            "train.py",
        ]
    else:
        notes.append("torchx: not installed (pip install --no-deps torchx plus its light deps)")
    if importlib.util.find_spec("submitit") and shutil.which("srun"):
        cmds["submitit"] = [py, "-c", SUBMITIT]
        if teardown:
            cmds["submitit-x"] = [
                py,
                "-c",
                SUBMITIT + "import os, sys\nsys.stdout.flush()\nos._exit(0)\n",
            ]
    else:
        notes.append("submitit: not installed, or no srun on PATH (its constructor needs one)")
    return cmds, notes


def run_once(argv: list[str], cwd: str, env: dict[str, str]) -> float:
    """Wall seconds of one run; a failing command stops the benchmark."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or ("#SBATCH" not in proc.stdout and argv[-1] != "pass"):
        raise SystemExit(f"{argv[0]} ... failed (rc {proc.returncode}): {proc.stderr[-400:]}")
    return wall


def file_syscalls(argv: list[str], cwd: str, env: dict[str, str]) -> int | None:
    """File-system system calls of one run of ``argv`` (None without strace)."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        subprocess.run(
            [strace, "-f", "-c", "-o", out.name, "-e", "trace=%file,read,getdents64", *argv],
            cwd=cwd,
            env=env,
            capture_output=True,
            check=True,
        )
        total = (
            out.read().strip().splitlines()[-1].split()
        )  # "100.00 secs usecs calls errors total"
    return int(total[3])


def main() -> int:
    """Time the commands in interleaved rounds and print medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument(
        "--teardown",
        action="store_true",
        help="add hpc-x and submitit-x: the same, ending in os._exit",
    )
    parser.add_argument(
        "--syscalls",
        action="store_true",
        help="count each command's file-system calls once (strace -c)",
    )
    args = parser.parse_args()
    cmds, notes = commands(args.teardown)
    env = dict(os.environ, SBATCH_ACCOUNT="m0000_g")
    # Time hpc as installed: pip byte-compiles packages, so let the warm-up run write
    # hpc's .pyc files (the peers' are in site-packages already).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    times: dict[str, list[float]] = {name: [] for name in cmds}
    with tempfile.TemporaryDirectory() as cwd:
        Path(cwd, "train.py").write_text("print('train')\n")
        for argv in cmds.values():  # warm the page cache once
            run_once(argv, cwd, env)
        for i in range(args.rounds):
            order = list(cmds.items())
            if i % 2:  # alternate the order so no command always runs first
                order.reverse()
            for name, argv in order:
                times[name].append(run_once(argv, cwd, env))
        calls = (
            {name: file_syscalls(argv, cwd, env) for name, argv in cmds.items()}
            if args.syscalls
            else {}
        )
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"medians of {args.rounds} interleaved rounds (wall, whole process):")
    for name, value in med.items():
        print(f"  {name:9s} {value * 1000:7.1f} ms")
    above = med["hpc"] - med["floor"]
    print(f"  hpc above the interpreter floor: {above * 1000:.1f} ms")
    for name in ("hpc", "submitit"):
        if f"{name}-x" in med:
            cost = (med[name] - med[f"{name}-x"]) * 1000
            print(f"  {name} teardown (whole - ended by os._exit): {cost:.1f} ms")
    for peer, target in (("torchx", 0.5), ("submitit", 1.0)):
        if peer in med:
            ratio = med["hpc"] / med[peer]
            verdict = "meets" if ratio <= target else "MISSES"
            print(f"  hpc / {peer:8s} = {ratio:.2f}  ({verdict} the <= {target} target)")
    if calls and None in calls.values():
        print("  skipped --syscalls: no strace on PATH")
    elif calls:
        print("file-system system calls of one run (strace -c), and above the floor's:")
        for name, n in calls.items():
            print(f"  {name:9s} {n:6d}  (+{n - calls['floor']})")
    for note in notes:
        print(f"  skipped {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
