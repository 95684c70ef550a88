"""``hpc``'s argument parser: one subparser per command, built alone when only one is asked
for (``hpc render`` builds just its own, so it starts fast), and the argparse types of its
number flags. Each subparser names its handler (:mod:`hpc.cli.commands`,
:mod:`hpc.cli.tables`) as ``func``."""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, NoReturn

from hpc._util import MAX_COUNT
from hpc.cli.commands import cmd_cancel, cmd_logs, cmd_render, cmd_status, cmd_submit
from hpc.cli.tables import cmd_clusters, cmd_doctor, cmd_report, cmd_scale
from hpc.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse that raises UserError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UserError(message if self.prog == "hpc" else f"{self.prog}: {message}")


def _whole(text: str) -> int:
    """An argparse type: ASCII digits only (``int()`` takes ``٣`` and ``３``), 0..MAX_COUNT."""
    if not re.fullmatch(r"[0-9]{1,8}", text.strip()) or int(text) > MAX_COUNT:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed; allowed: a whole number in ASCII digits, 0 to {MAX_COUNT:,}"
        )
    return int(text)


def _finite(text: str) -> float:
    """An argparse type: a finite number (``float()`` takes ``nan``, ``inf``, ``1e999``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not text.strip().isascii():
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a finite number")
    return value


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="job spec YAML (e.g. jobs/dpo_aurora.yaml)")
    p.add_argument("--cluster", help="cluster profile (hpc clusters lists them)")
    p.add_argument("--nodes", help="number of nodes")
    p.add_argument("--ppn", help="ranks per node (default: the profile's)")
    p.add_argument("--walltime", help="HH:MM:SS")
    p.add_argument("--queue", "--partition", dest="queue", help="queue / partition / qos")
    p.add_argument(
        "--account", help="project allocation (else $PBS_ACCOUNT/$SBATCH_ACCOUNT/$HPC_ACCOUNT)"
    )
    p.add_argument("--name", help="job name (reduced to scheduler-safe characters)")
    p.add_argument("--gpus-per-node", help="ask the scheduler for GPUs (SLURM, generic PBS)")
    p.add_argument(
        "--launcher", help="auto, mpiexec, srun or torchrun (SLURM: one torchrun per node)"
    )
    p.add_argument("--wrap", help="auto, always or never: run the command under python -m ddp.exec")
    p.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="export K=V in the job"
    )
    p.add_argument("--templates", help="directory of templates overriding the built-in ones")
    p.add_argument(
        "--expand-vars",
        action="store_true",
        default=None,
        help="let command words use $NAME/${NAME}, expanded by the job's shell "
        "(as expand_vars: true in a spec)",
    )
    p.add_argument(
        "--resilience",
        action="store_true",
        default=None,
        help="run the launch under python -m ddp.supervise (a hung or dead "
        "rank's node excluded, the rest relaunched; as resilience: true)",
    )
    p.add_argument(
        "--per-rank-logs",
        action="store_true",
        default=None,
        help="each rank's output also in RUN/ranks/rank-NNNNN.log "
        "(as per_rank_logs: true in a spec)",
    )
    p.add_argument("-o", "--output", help="write the script here instead of printing it")


COMMANDS = (
    "render",
    "submit",
    "run",
    "status",
    "cancel",
    "logs",
    "report",
    "clusters",
    "doctor",
    "scale",
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``only`` builds just that subcommand (faster startup)."""
    common = _Parser(add_help=False)  # a parent only: its error() is never called
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    parser = _Parser(
        prog="hpc",
        description="Render and submit DDP jobs to PBS, SLURM or this machine.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    def want(name: str) -> bool:
        return only is None or only == name

    if want("render"):
        _render_parser(sub, common)
    for name, helptext in (
        ("submit", "render, record a run directory, submit"),
        ("run", "run the job on this machine now (cluster local)"),
    ):
        if want(name):
            _submit_parser(sub, common, name, helptext)
    for name, fn in (("status", cmd_status), ("cancel", cmd_cancel)):
        if want(name):
            _id_parser(sub, common, name, fn)
    if want("logs"):
        _logs_parser(sub, common)
    if want("report"):
        p = sub.add_parser(
            "report",
            parents=[common],
            help="plots (PNG) and a summary table of runs' metrics.jsonl",
        )
        p.add_argument("run_dirs", nargs="+", help="run directories (a sweep's tasks overlay)")
        p.add_argument("-o", "--output", help="PNG path or folder (default: the first run's)")
        p.set_defaults(func=cmd_report)
    if want("clusters"):
        p = sub.add_parser("clusters", parents=[common], help="list cluster profiles")
        p.set_defaults(func=cmd_clusters)
    if want("doctor"):
        p = sub.add_parser("doctor", parents=[common], help="what this machine has")
        p.add_argument("--no-torch", action="store_true", help="skip the torch probe")
        p.set_defaults(func=cmd_doctor)
    if want("scale"):
        _scale_parser(sub, common)
    return parser


def _scale_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "scale", parents=[common], help="lr / warmup / effective batch for 1..N GPUs"
    )
    p.add_argument("--gpus", type=_whole, required=True)
    p.add_argument(
        "--rule",
        default="linear",
        help="none, linear, sqrt or cap:N (factor min(gpus/base-gpus, N), N >= 1)",
    )
    p.add_argument("--base-lr", type=_finite, required=True)
    p.add_argument("--base-warmup", type=_whole, default=0)
    p.add_argument("--batch-size", type=_whole, default=1)
    p.add_argument("--accum", type=_whole, default=1)
    p.add_argument(
        "--base-gpus",
        type=_whole,
        default=1,
        help="GPU count base-lr was tuned at (scaling.base_world_size)",
    )
    p.add_argument(
        "--by",
        default="world",
        choices=("world", "batch"),
        help="what grows: the GPU count, or the effective batch against --base-batch (scaling.by)",
    )
    p.add_argument(
        "--base-batch",
        type=_whole,
        default=0,
        help="with --by batch: effective batch base-lr was tuned for (scaling.base_batch_size)",
    )
    p.set_defaults(func=cmd_scale)


def _render_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("render", parents=[common], help="print or write the job script")
    _job_args(p)
    p.add_argument(
        "--no-account",
        action="store_true",
        help="leave the account directive out; give it at submit (qsub -A PROJECT)",
    )
    p.add_argument(
        "--all-jobs",
        action="store_true",
        help="re-render every spec under --jobs-dir next to it (the checked-in scripts)",
    )
    p.add_argument("--jobs-dir", default="jobs", help="folder of specs for --all-jobs")
    p.add_argument(
        "--check", action="store_true", help="with --all-jobs: fail if a script is stale"
    )
    p.set_defaults(func=cmd_render)


def _submit_parser(sub: Any, common: argparse.ArgumentParser, name: str, helptext: str) -> None:
    """``hpc submit`` and ``hpc run`` (the same flags; ``run`` is this machine's)."""
    p = sub.add_parser(name, parents=[common], help=helptext)
    _job_args(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the script and the submit command; submit nothing",
    )
    p.add_argument("--runs-dir", default="runs", help="where run directories go")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="submit again into an existing run directory (the job "
        "resumes from its checkpoints there; nothing is overwritten)",
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="one job array over every combination: each task runs with "
        "--set KEY=V in its own folder (repeat for more keys)",
    )
    p.add_argument(
        "--max-parallel",
        type=_whole,
        metavar="N",
        help="with --sweep: at most N tasks at once (SLURM %%N, PBS -J ...%%N)",
    )
    p.add_argument(
        "--chain",
        default="1",
        metavar="N",
        help="queue N segments at once, each afterany the one before, all "
        "in one run directory (resumed from its checkpoints); those "
        "after the one that finished end at once",
    )
    p.add_argument(
        "--after",
        metavar="JOBID[:ok|any|notok]",
        help="start only once that job ended (ok: exit 0, the default; "
        "any; notok); an array's id means all its tasks",
    )
    p.set_defaults(func=cmd_submit, local=name == "run")


def _id_parser(sub: Any, common: argparse.ArgumentParser, name: str, fn: Any) -> None:
    """``hpc status`` and ``hpc cancel``: a job id or run directory (status adds --watch)."""
    p = sub.add_parser(name, parents=[common], help=f"{name} a job (job id or run directory)")
    p.add_argument("id", help="scheduler job id, run directory, or its name under --runs-dir")
    p.add_argument("--cluster", help="cluster profile, to say which scheduler")
    p.add_argument("--runs-dir", default="runs")
    if name == "status":
        p.add_argument(
            "--watch",
            action="store_true",
            help="a live view (state, latest metrics, slowest rank, "
            "restarts) until the job ends; exits with its status",
        )
    p.set_defaults(func=fn)


def _logs_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """``hpc logs``: the job log, its stderr, one rank's log, a grep of every rank's."""
    p = sub.add_parser("logs", parents=[common], help="print a job's log; -f follows it")
    p.add_argument("id", help="run directory, its name under --runs-dir, or a job id")
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing while the job runs; exit with its state's code",
    )
    p.add_argument(
        "--err",
        action="store_true",
        help="the job's stderr log (a job submitted with split_logs: true)",
    )
    p.add_argument(
        "--rank",
        type=int,
        metavar="N",
        help="rank N's own log (a job submitted with per_rank_logs: true)",
    )
    p.add_argument(
        "--grep",
        metavar="TEXT",
        help="the lines of every rank's log holding TEXT, with rank and host",
    )
    p.add_argument("--runs-dir", default="runs")
    p.set_defaults(func=cmd_logs)
