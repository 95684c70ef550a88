"""The ``hpc`` command: argument parsing and printing over the library in ``hpc.core``.

Commands: render, submit, run, status, cancel, clusters, doctor, scale. Every
expected failure (``hpc.errors.HpcError``) becomes one stderr line ``hpc: error: ...``
with its exit code: 2 for a user mistake, 3 for a scheduler that failed or could not
be reached; ``--debug`` adds the traceback. ``render`` and ``submit --dry-run`` import
neither torch, submitit nor rich, so they answer in a few tens of milliseconds.
Nothing but ``hpc.__main__`` imports this module.

The command to run comes after ``--``: ``hpc render --cluster aurora -- python train.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from hpc import core
from hpc._util import write_atomic
from hpc.errors import HpcError, UserError

_OVERRIDES = (
    ("cluster", "--cluster"), ("nodes", "--nodes"), ("ppn", "--ppn"), ("walltime", "--walltime"),
    ("queue", "--queue"), ("account", "--account"), ("name", "--name"),
    ("gpus_per_node", "--gpus-per-node"), ("launcher", "--launcher"), ("wrap", "--wrap"),
)


class _Parser(argparse.ArgumentParser):
    """argparse that raises UserError instead of printing usage and exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UserError(message if self.prog == "hpc" else f"{self.prog}: {message}")


MAX_COUNT = 10_000_000
"""Largest count a flag takes (GPUs, batch, steps): past any machine, short of overflow."""


def _whole(text: str) -> int:
    """An argparse type: ASCII digits only (``int()`` takes ``٣`` and ``３``), 0..MAX_COUNT."""
    if not re.fullmatch(r"[0-9]{1,8}", text.strip()) or int(text) > MAX_COUNT:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed; allowed: a whole number in ASCII digits, 0 to {MAX_COUNT:,}")
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
    p.add_argument("--account", help="project allocation (else $PBS_ACCOUNT/$SBATCH_ACCOUNT/$HPC_ACCOUNT)")
    p.add_argument("--name", help="job name (reduced to scheduler-safe characters)")
    p.add_argument("--gpus-per-node", help="ask the scheduler for GPUs (SLURM, generic PBS)")
    p.add_argument("--launcher", help="auto, mpiexec, srun or torchrun (SLURM: one torchrun per node)")
    p.add_argument("--wrap", help="auto, always or never: run the command under python -m ddp.exec")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="export K=V in the job")
    p.add_argument("--templates", help="directory of templates overriding the built-in ones")
    p.add_argument("--expand-vars", action="store_true", default=None,
                   help="let command words use $NAME/${NAME}, expanded by the job's shell "
                        "(as expand_vars: true in a spec)")
    p.add_argument("--resilience", action="store_true", default=None,
                   help="run the launch under python -m ddp.supervise (a hung or dead "
                        "rank's node excluded, the rest relaunched; as resilience: true)")
    p.add_argument("--per-rank-logs", action="store_true", default=None,
                   help="each rank's output also in RUN/ranks/rank-NNNNN.log "
                        "(as per_rank_logs: true in a spec)")
    p.add_argument("-o", "--output", help="write the script here instead of printing it")


COMMANDS = ("render", "submit", "run", "status", "cancel", "logs", "report", "clusters", "doctor",
            "scale")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``only`` builds just that subcommand (faster startup)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    parser = _Parser(prog="hpc", description="Render and submit DDP jobs to PBS, SLURM or this machine.",
                     parents=[common])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    def want(name: str) -> bool:
        return only is None or only == name

    if want("render"):
        _render_parser(sub, common)
    for name, helptext in (("submit", "render, record a run directory, submit"),
                           ("run", "run the job on this machine now (cluster local)")):
        if want(name):
            p = sub.add_parser(name, parents=[common], help=helptext)
            _job_args(p)
            p.add_argument("--dry-run", action="store_true",
                           help="print the script and the submit command; submit nothing")
            p.add_argument("--runs-dir", default="runs", help="where run directories go")
            p.add_argument("--resume", metavar="RUN_DIR",
                           help="submit again into an existing run directory (the job "
                                "resumes from its checkpoints there; nothing is overwritten)")
            p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                           help="one job array over every combination: each task runs with "
                                "--set KEY=V in its own folder (repeat for more keys)")
            p.add_argument("--max-parallel", type=_whole, metavar="N",
                           help="with --sweep: at most N tasks at once (SLURM %%N, PBS -J ...%%N)")
            p.add_argument("--chain", default="1", metavar="N",
                           help="queue N segments at once, each afterany the one before, all "
                                "in one run directory (resumed from its checkpoints); those "
                                "after the one that finished end at once")
            p.add_argument("--after", metavar="JOBID[:ok|any|notok]",
                           help="start only once that job ended (ok: exit 0, the default; "
                                "any; notok); an array's id means all its tasks")
            p.set_defaults(func=cmd_submit, local=name == "run")
    for name, fn in (("status", "cmd_status"), ("cancel", "cmd_cancel")):
        if want(name):
            p = sub.add_parser(name, parents=[common], help=f"{name} a job (job id or run directory)")
            p.add_argument("id", help="scheduler job id, run directory, or its name under --runs-dir")
            p.add_argument("--cluster", help="cluster profile, to say which scheduler")
            p.add_argument("--runs-dir", default="runs")
            if name == "status":
                p.add_argument("--watch", action="store_true",
                               help="a live view (state, latest metrics, slowest rank, "
                                    "restarts) until the job ends; exits with its status")
            p.set_defaults(func=globals()[fn])
    if want("logs"):
        p = sub.add_parser("logs", parents=[common], help="print a job's log; -f follows it")
        p.add_argument("id", help="run directory, its name under --runs-dir, or a job id")
        p.add_argument("-f", "--follow", action="store_true",
                       help="keep printing while the job runs; exit with its state's code")
        p.add_argument("--err", action="store_true",
                       help="the job's stderr log (a job submitted with split_logs: true)")
        p.add_argument("--rank", type=int, metavar="N",
                       help="rank N's own log (a job submitted with per_rank_logs: true)")
        p.add_argument("--grep", metavar="TEXT",
                       help="the lines of every rank's log holding TEXT, with rank and host")
        p.add_argument("--runs-dir", default="runs")
        p.set_defaults(func=cmd_logs)
    if want("report"):
        p = sub.add_parser("report", parents=[common],
                           help="plots (PNG) and a summary table of runs' metrics.jsonl")
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
    p = sub.add_parser("scale", parents=[common], help="lr / warmup / effective batch for 1..N GPUs")
    p.add_argument("--gpus", type=_whole, required=True)
    p.add_argument("--rule", default="linear",
                   help="none, linear, sqrt or cap:N (factor min(gpus/base-gpus, N), N >= 1)")
    p.add_argument("--base-lr", type=_finite, required=True)
    p.add_argument("--base-warmup", type=_whole, default=0)
    p.add_argument("--batch-size", type=_whole, default=1)
    p.add_argument("--accum", type=_whole, default=1)
    p.add_argument("--base-gpus", type=_whole, default=1,
                   help="GPU count base-lr was tuned at (scaling.base_world_size)")
    p.add_argument("--by", default="world", choices=("world", "batch"),
                   help="what grows: the GPU count, or the effective batch against "
                        "--base-batch (scaling.by)")
    p.add_argument("--base-batch", type=_whole, default=0,
                   help="with --by batch: effective batch base-lr was tuned for "
                        "(scaling.base_batch_size)")
    p.set_defaults(func=cmd_scale)


def _render_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("render", parents=[common], help="print or write the job script")
    _job_args(p)
    p.add_argument("--no-account", action="store_true",
                   help="leave the account directive out; give it at submit (qsub -A PROJECT)")
    p.add_argument("--all-jobs", action="store_true",
                   help="re-render every spec under --jobs-dir next to it (the checked-in scripts)")
    p.add_argument("--jobs-dir", default="jobs", help="folder of specs for --all-jobs")
    p.add_argument("--check", action="store_true", help="with --all-jobs: fail if a script is stale")
    p.set_defaults(func=cmd_render)


# --- job building -------------------------------------------------------------------


def _env_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--env: {item!r} is not NAME=VALUE; allowed: e.g. --env OMP_NUM_THREADS=4")
        out[key] = value
    return out


def _overrides(args: argparse.Namespace, command: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {key: getattr(args, key) for key, _ in _OVERRIDES}
    if args.env:
        out["env"] = _env_pairs(args.env)
    if command:
        out["command"] = command
    if args.expand_vars:
        out["expand_vars"] = True
    if args.per_rank_logs:
        out["per_rank_logs"] = True
    if args.resilience:
        out["resilience"] = True
    return out


def _regen_command(args: argparse.Namespace, command: list[str] | None) -> str:
    """The ``hpc render`` line that reproduces this script (flags, not the environment)."""
    words = ["hpc", "render"]
    if args.spec:
        words.append(args.spec)
    for key, flag in _OVERRIDES:
        if key == "cluster" and getattr(args, "local", False):
            words += [flag, "local"]  # hpc run: the script is this machine's
        elif getattr(args, key) is not None:
            words += [flag, str(getattr(args, key))]
    for item in args.env:
        words += ["--env", item]
    if args.templates:
        words += ["--templates", args.templates]
    if args.expand_vars:
        words.append("--expand-vars")
    if args.per_rank_logs:
        words.append("--per-rank-logs")
    if args.resilience:
        words.append("--resilience")
    if getattr(args, "no_account", False):
        words.append("--no-account")
    if args.output:
        words += ["-o", args.output]
    if command:
        words += ["--", *command]
    return shlex.join(words)


def _job_sees(job: Any) -> str:
    """``# the job sees: WORDS`` when the spec's command uses variables (``expand_vars``),
    each one replaced by its value here; "" otherwise. Why: the script shows
    ``"${SCRATCH:?}"/x``, and whether that is the folder meant is known only with the value.
    """
    from hpc.launchers import VAR, expand_here
    from hpc.render import comment

    words = job.spec.command
    if not job.spec.expand_vars or not any(re.search(VAR, w) for w in words):
        return ""
    environ = {**os.environ, **job.cluster.env, **job.spec.env}  # the spec's own exports too
    seen, missing = zip(*(expand_here(w, environ) for w in words), strict=True)
    unknown = sorted({name for names in missing for name in names})
    note = f" (not set here: {', '.join(unknown)})" if unknown else ""
    return comment(f"# the job sees{note}: {shlex.join(seen)}") + "\n"


# --- commands -----------------------------------------------------------------------


def cmd_render(args: argparse.Namespace, command: list[str] | None) -> int:
    """Print or write the job script."""
    if args.all_jobs:
        return _render_all(args, command)
    if args.check:
        raise UserError("--check: only with --all-jobs")
    job = core.build_job(args.spec, _overrides(args, command), defer_account=args.no_account)
    text = core.render_job(job, regenerate=_regen_command(args, command), templates=args.templates,
                           script=args.output)
    seen = _job_sees(job)
    if seen:
        sys.stderr.write(seen)
    if args.output:
        out = Path(args.output)
        write_atomic(out, text)
        sys.stderr.write(f"wrote {out}\n")
    else:
        sys.stdout.write(text)
    return 0


def _render_all(args: argparse.Namespace, command: list[str] | None) -> int:
    given = [flag for key, flag in _OVERRIDES if getattr(args, key) is not None]
    if given or command or args.spec or args.env or args.output:
        raise UserError(f"--all-jobs: renders the specs as they are; allowed: no spec, flags or command "
                        f"(got {', '.join(given) or 'a spec or command'})")
    rendered = core.render_all(Path(args.jobs_dir), args.templates)
    stale = [p for p, text in rendered.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
    if args.check:
        if stale:
            raise UserError(f"{', '.join(map(str, stale))}: out of date with the specs; "
                            "allowed: regenerate with hpc render --all-jobs")
        return 0
    for path in stale:
        write_atomic(path, rendered[path], "--all-jobs")
        sys.stderr.write(f"wrote {path}\n")
    return 0


def cmd_submit(args: argparse.Namespace, command: list[str] | None) -> int:
    """Render, write a run directory, submit; or with --dry-run print what would be submitted."""
    job = core.build_job(args.spec, _overrides(args, command), run_here=args.local)
    tasks = None
    if args.sweep:
        from hpc.sweep import tasks_from_flags

        tasks = tasks_from_flags(args.sweep)
    from hpc.chain import parse_after, whole

    chain = whole(args.chain)
    after = parse_after(args.after, job.scheduler.owns_id) if args.after is not None else None
    plan = core.plan_submit(job, Path(args.runs_dir), resume=args.resume,
                            regenerate=_regen_command(args, command), templates=args.templates,
                            sweep=tasks, max_parallel=args.max_parallel, chain=chain, after=after)
    from hpc.charges import balance_warning, max_charge_line

    j = plan.job
    for note in plan.notes:  # e.g. a sweep throttled to its queue's array limit
        sys.stderr.write(note + "\n")
    for line in (max_charge_line(j.cluster, j.nodes, j.walltime, j.queue),
                 balance_warning(j.cluster, j.account, j.nodes, j.walltime, j.queue)):
        if line:  # stderr: `hpc submit` stdout stays the job id alone
            sys.stderr.write(line + "\n")
    if chain and chain > 1 and j.cluster.charge:
        sys.stderr.write(f"hpc: a chain of {chain} segments may use {chain} times that\n")
    if args.dry_run:
        argv = plan.scheduler.submit_command(args.output) if args.output else plan.argv
        sys.stdout.write(plan.text)
        sys.stdout.write(_job_sees(plan.job))
        sys.stdout.write(f"# submit: {shlex.join(argv)}\n")
        for k, (offset, count) in enumerate(plan.parts[1:], 2):  # a sweep split by MaxArraySize
            from hpc.chain import After

            prev = After(f"ARRAY{k - 1}", "any") if plan.job.max_parallel else plan.after
            then = plan.scheduler.array_part_command(str(plan.script), count, offset,
                                                     plan.job.max_parallel, prev)
            sys.stdout.write(f"# then array {k}/{len(plan.parts)}: {shlex.join(then)}\n")
        for k in range(2, plan.chain + 1):
            from hpc.chain import After

            then = plan.scheduler.submit_command(str(plan.script), After(f"SEGMENT{k - 1}", "any"))
            sys.stdout.write(f"# then segment {k}/{plan.chain}: {shlex.join(then)}\n")
        return 0
    done = core.submit(plan)
    sys.stderr.write(f"run directory: {done.run_dir}\n")
    if done.submission.exit_code is not None:  # ran here to the end
        return done.submission.exit_code
    sys.stdout.write(f"{done.submission.job_id}\n")
    if plan.chain > 1:
        sys.stderr.write(f"chain: {plan.chain} segments queued, each afterany the one before "
                         f"(hpc status {done.run_dir} lists them)\n")
    return 0


def cmd_status(args: argparse.Namespace, command: list[str] | None) -> int:
    """Print ``JOBID STATE`` with the state normalized; a sweep adds a line per task
    (the job and its tasks are one scheduler query); a supervised run adds its restarts
    and excluded nodes; a failed job adds its failing rank's last lines on stderr
    (:mod:`hpc.failure`). ``--watch``: :mod:`hpc.watch`."""
    from hpc import runs, watch

    if getattr(args, "watch", False):
        return watch.run(args.id, Path(args.runs_dir), args.cluster, sys.stdout, sys.stderr,
                         tty=sys.stdout.isatty())
    job_id, state, tasks = core.run_status(args.id, Path(args.runs_dir), args.cluster)
    sys.stdout.write(f"{job_id} {state}\n")
    for task_id, label, task_state in tasks:
        sys.stdout.write(f"{task_id} {task_state} {label}\n")
    found = runs.find(args.id, Path(args.runs_dir), history=True)
    restarts, excluded, stopped = watch.supervisor_events(found[1] if found else {})
    if restarts or excluded or stopped:  # on stderr: scripts read stdout's JOBID STATE lines
        sys.stderr.write(watch.supervisor_line(restarts, excluded, stopped) + "\n")
    if found and state == "FAILED":  # issue 31.2: the failing rank's last lines
        from hpc import failure, logs

        job = logs.locate(args.id, Path(args.runs_dir))[1]
        for line in failure.failing_rank_lines(found[0], found[1], job):
            sys.stderr.write(line + "\n")
    return 0


def cmd_logs(args: argparse.Namespace, command: list[str] | None) -> int:
    """Print the job's log; with -f follow it until the job ends (exit 0 if it completed)."""
    from hpc import logs

    runs_dir = Path(args.runs_dir)
    if (args.grep is not None or args.rank is not None) and Path(args.id).is_dir():
        run_dir, job = Path(args.id), None  # a job's folder, with or without a run record
    else:
        run_dir, job = logs.locate(args.id, runs_dir)
    if args.grep is not None:
        found = logs.grep(run_dir, args.grep, sys.stdout, job)
        where = ", ".join(f"rank {r} ({h})" for r, h in found)
        sys.stderr.write(f"hpc: {args.grep!r} found in {where}\n" if found else
                         f"hpc: {args.grep!r} is in no rank's log\n")  # fmt: skip
        return 0 if found else 1
    if args.rank is not None:
        if args.rank < 0:
            raise UserError(f"logs: --rank {args.rank}; allowed: a rank >= 0")
        if not logs.rank_logs(run_dir):  # no own files: the labelled lines of the job log
            if args.follow or args.err:
                raise UserError("logs: --rank with -f or --err needs per-rank files; allowed: "
                                "--rank alone for a job log with rank labels")  # fmt: skip
            logs.print_rank(run_dir, args.rank, sys.stdout, job)
            return 0
        path = logs.rank_log(run_dir, args.rank)
    else:
        path = logs.find_log(run_dir, job)
    if args.err:
        path = logs.err_log(run_dir, path)
    if not args.follow:
        logs.print_log(path, sys.stdout)
        return 0
    ident = job or str(run_dir)
    states: list[Any] = []
    state, poll_s = core.watch(ident, runs_dir, run_dir)  # found once, not once a poll

    def running() -> bool:
        states.append(state())
        return not states[-1].ended and states[-1] != "UNKNOWN"

    logs.follow(path, running, sys.stdout, settle_s=2.0, ask=logs.Backoff(1.0, poll_s))
    final = states[-1] if states else None
    sys.stderr.write(f"hpc: job ended: {final}\n")
    code = core.exit_code(ident, runs_dir)  # the job's own: its record's or its scheduler's
    if final in (None, "COMPLETED"):
        return 0 if code is None else code
    return code or 1  # never 0 for a job that did not complete (PBS: qdel can say 0)


def cmd_report(args: argparse.Namespace, command: list[str] | None) -> int:
    """Plot the runs' metrics into a PNG and print a summary table."""
    from rich.text import Text

    from hpc import fingerprint
    from hpc.report import report

    console = _console()
    report([Path(d) for d in args.run_dirs], Path(args.output) if args.output else None,
           console=console)
    for run_dir in args.run_dirs:  # what ran, and what changed since the last submission
        for line in fingerprint.describe(Path(run_dir)):
            console.print(Text(line))
    from hpc.charges import used_lines

    for run_dir in args.run_dirs:  # node-hours each submission used, and their total
        for line in used_lines(Path(run_dir)):
            console.print(Text(line))
    return 0


def cmd_cancel(args: argparse.Namespace, command: list[str] | None) -> int:
    """Cancel the job through its scheduler."""
    job_id = core.cancel(args.id, Path(args.runs_dir), args.cluster)
    sys.stdout.write(f"{job_id} cancel requested\n")
    return 0


def _console() -> Any:
    """A rich console, 120 columns wide when output is not a terminal (pipes, tests).

    Markup is off: what the commands print is the user's text (run and profile names,
    queue names, paths, sweep labels), and ``[/x]`` in it raised ``MarkupError`` while
    ``[bold]`` restyled it. Styles are given as ``rich.text.Text`` objects instead.

    Rich answers a closed pipe by exiting 1 itself (``Console.on_broken_pipe``); here
    the error goes on to ``hpc._pipes``, so ``hpc clusters | head -1`` ends as every
    other command does (quietly, 141)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    console = _Console(markup=False)
    return console if console.is_terminal else _Console(width=120, markup=False)


def cmd_clusters(args: argparse.Namespace, command: list[str] | None) -> int:
    """A table of the cluster profiles."""
    from rich.table import Table

    from hpc import profiles as clusters
    from hpc._util import format_walltime

    table = Table(title="cluster profiles")
    for col in ("name", "scheduler", "devices/node", "ppn", "account", "queues"):
        table.add_column(col, no_wrap=col in ("name", "queues"))
    for c in clusters.load_all():
        queues = "\n".join(
            f"{q.name} {q.min_nodes}-{q.max_nodes} "
            + (format_walltime(q.max_walltime) if q.max_walltime else "")
            + (" (by size)" if q.bins else "")
            for q in c.queues.values()
        ) or "any"
        devices = f"{c.devices_per_node} {c.device}" if c.devices_per_node else c.device
        table.add_row(c.name, c.scheduler, devices, str(c.ppn),
                      "required" if c.account_required else "optional", queues)
    _console().print(table)
    return 0


def cmd_doctor(args: argparse.Namespace, command: list[str] | None) -> int:
    """A found/missing table of what this machine has."""
    from rich.table import Table
    from rich.text import Text

    from hpc.doctor import rows

    table = Table(title="hpc doctor")
    for col in ("kind", "item", "status", "detail"):
        table.add_column(col)
    for kind, item, ok, detail in rows(probe_torch=not args.no_torch):
        status = Text("found", style="green") if ok else Text("missing", style="yellow")
        table.add_row(kind, item, status, detail)
    _console().print(table)
    return 0


def cmd_scale(args: argparse.Namespace, command: list[str] | None) -> int:
    """lr / warmup / effective batch for 1..N GPUs, doubling."""
    from rich.table import Table

    from hpc.scale import table as scale_table

    rows = scale_table(args.gpus, args.rule, args.base_lr, args.base_warmup, args.batch_size, args.accum,
                       args.base_gpus, by=args.by, base_batch=args.base_batch)
    tuned = f", base lr and warmup tuned at {args.base_gpus} GPUs" if args.base_gpus != 1 else ""
    if args.by == "batch":
        tuned = f", base lr and warmup tuned at effective batch {args.base_batch}"
    table = Table(title=f"scaling rule {args.rule}: batch {args.batch_size} x accum {args.accum} per GPU{tuned}")
    for col in ("GPUs", "effective batch", "factor", "lr", "warmup"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.gpus), str(r.effective_batch), f"{r.factor:g}", f"{r.lr:.3g}", str(r.warmup))
    _console().print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hpc`` and ``python -m hpc``; returns the exit code (141, quietly,
    once the reader of its output is gone: ``hpc logs RUN | head -1``)."""
    from hpc._pipes import run_main

    return run_main(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] | None = None
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    debug = "--debug" in argv
    wanted = next((a for a in argv if not a.startswith("-")), None)
    try:
        if wanted is not None and wanted not in COMMANDS:
            from hpc._util import did_you_mean

            raise UserError(f"command: {wanted!r} is not a command{did_you_mean(wanted, COMMANDS)}; "
                            f"allowed: {', '.join(COMMANDS)}")
        parser = build_parser(wanted)
        args = parser.parse_args(argv)
        if args.command is None:
            raise UserError(f"command: missing; allowed: {', '.join(COMMANDS)}")
        if command is not None and args.command not in ("render", "submit", "run"):
            raise UserError(f"--: {args.command} takes no command after --")
        return int(args.func(args, command))
    except HpcError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        sys.stderr.write(f"hpc: error: {exc}\n")
        return int(getattr(exc, "exit_code", 2))
    except SystemExit as exc:  # --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    except KeyboardInterrupt:
        sys.stderr.write("hpc: interrupted\n")
        return 130
