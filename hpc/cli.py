"""The ``hpc`` command: render, submit, run, status, cancel, clusters, doctor, scale.

User mistakes (``UserError``) become one stderr line ``hpc: error: ...`` and exit
code 2; ``--debug`` adds the traceback. ``render`` and ``submit --dry-run`` import
neither torch, submitit nor rich, so they answer in a few tens of milliseconds.

The command to run comes after ``--``: ``hpc render --cluster aurora -- python train.py``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from hpc._util import write_atomic
from hpc.errors import UserError

_OVERRIDES = (
    ("cluster", "--cluster"), ("nodes", "--nodes"), ("ppn", "--ppn"), ("walltime", "--walltime"),
    ("queue", "--queue"), ("account", "--account"), ("name", "--name"),
    ("gpus_per_node", "--gpus-per-node"), ("launcher", "--launcher"), ("wrap", "--wrap"),
)


class _Parser(argparse.ArgumentParser):
    """argparse that raises UserError instead of printing usage and exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UserError(message if self.prog == "hpc" else f"{self.prog}: {message}")


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
    p.add_argument("-o", "--output", help="write the script here instead of printing it")


COMMANDS = ("render", "submit", "run", "status", "cancel", "clusters", "doctor", "scale")


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
            p.set_defaults(func=cmd_submit, local=name == "run")
    for name, fn in (("status", "cmd_status"), ("cancel", "cmd_cancel")):
        if want(name):
            p = sub.add_parser(name, parents=[common], help=f"{name} a job (job id or run directory)")
            p.add_argument("id", help="scheduler job id, run directory, or its name under --runs-dir")
            p.add_argument("--cluster", help="cluster profile, to say which scheduler")
            p.add_argument("--runs-dir", default="runs")
            p.set_defaults(func=globals()[fn])
    if want("clusters"):
        p = sub.add_parser("clusters", parents=[common], help="list cluster profiles")
        p.set_defaults(func=cmd_clusters)
    if want("doctor"):
        p = sub.add_parser("doctor", parents=[common], help="what this machine has")
        p.add_argument("--no-torch", action="store_true", help="skip the torch probe")
        p.set_defaults(func=cmd_doctor)
    if want("scale"):
        p = sub.add_parser("scale", parents=[common], help="lr / warmup / effective batch for 1..N GPUs")
        p.add_argument("--gpus", type=int, required=True)
        p.add_argument("--rule", default="linear",
                       help="none, linear, sqrt or cap:N (factor min(gpus/base-gpus, N), N >= 1)")
        p.add_argument("--base-lr", type=float, required=True)
        p.add_argument("--base-warmup", type=int, default=0)
        p.add_argument("--batch-size", type=int, default=1)
        p.add_argument("--accum", type=int, default=1)
        p.add_argument("--base-gpus", type=int, default=1,
                       help="GPU count base-lr was tuned at (scaling.base_world_size)")
        p.set_defaults(func=cmd_scale)
    return parser


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
    if getattr(args, "no_account", False):
        words.append("--no-account")
    if args.output:
        words += ["-o", args.output]
    if command:
        words += ["--", *command]
    return shlex.join(words)


def build_job(
    spec_path: str | None, overrides: dict[str, Any], environ: dict[str, str] | None = None,
    defer_account: bool = False, cwd: Path | None = None, run_here: bool = False,
) -> Any:
    """Spec file + overrides -> a resolved Job (all checks done, nothing written)."""
    from hpc import cluster as clusters
    from hpc.spec import load_spec, resolve

    spec = load_spec(spec_path, overrides)
    if run_here and spec.cluster != "local":
        # ``hpc run`` of a cluster spec: same command, one node, one rank unless asked;
        # site-only keys mean nothing here.
        spec.cluster = "local"
        spec.nodes = int(overrides.get("nodes") or 1)
        spec.ppn = int(overrides["ppn"]) if str(overrides.get("ppn") or "").isdigit() else None
        spec.queue = spec.account = spec.gpus_per_node = spec.filesystems = None
        spec.launcher = "auto"
    if spec.cluster is None:
        raise UserError(
            "cluster: missing; allowed: --cluster NAME or cluster: in the spec, one of "
            + ", ".join(clusters.names(environ, cwd))
        )
    profile = clusters.load(spec.cluster, environ, cwd)
    return resolve(spec, profile, os.environ if environ is None else environ, defer_account)


# --- commands -----------------------------------------------------------------------


def cmd_render(args: argparse.Namespace, command: list[str] | None) -> int:
    """Print or write the job script."""
    from hpc.render import render

    if args.all_jobs:
        return _render_all(args, command)
    if args.check:
        raise UserError("--check: only with --all-jobs")
    job = build_job(args.spec, _overrides(args, command), defer_account=args.no_account)
    text = render(job, regenerate=_regen_command(args, command), templates=args.templates,
                  script=args.output)
    if args.output:
        out = Path(args.output)
        write_atomic(out, text)
        sys.stderr.write(f"wrote {out}\n")
    else:
        sys.stdout.write(text)
    return 0


def render_all(jobs_dir: Path, templates: str | None = None) -> dict[Path, str]:
    """Every ``jobs_dir/*.yaml`` rendered to ``jobs_dir/NAME.{pbs,slurm,sh}``.

    Independent of the caller's environment (no account from ``$PBS_ACCOUNT``, no
    user profiles): the checked-in scripts must be the same on every machine. A
    missing account is left to the submit command (``qsub -A PROJECT``).
    """
    from hpc.render import render

    specs = sorted(jobs_dir.glob("*.yaml"))
    if not specs:
        raise UserError(f"--jobs-dir: no *.yaml specs in {str(jobs_dir)!r}")
    out: dict[Path, str] = {}
    for path in specs:
        job = build_job(str(path), {}, environ={}, defer_account=True)
        target = path.with_suffix(job.cluster.script_suffix)
        out[target] = render(job, regenerate="hpc render --all-jobs", templates=templates,
                             script=str(target))
    return out


def _render_all(args: argparse.Namespace, command: list[str] | None) -> int:
    given = [flag for key, flag in _OVERRIDES if getattr(args, key) is not None]
    if given or command or args.spec or args.env or args.output:
        raise UserError(f"--all-jobs: renders the specs as they are; allowed: no spec, flags or command "
                        f"(got {', '.join(given) or 'a spec or command'})")
    rendered = render_all(Path(args.jobs_dir), args.templates)
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
    """Render, write a run directory, submit; or with --dry-run only print."""
    import time

    from hpc import runs, schedulers
    from hpc.render import render

    job = build_job(args.spec, _overrides(args, command), run_here=args.local)
    if job.spec.python is None:
        # The job runs with the Python this command runs from, on every scheduler (qsub,
        # unlike sbatch, passes no environment): see hpc.spec.submitting_python.
        from hpc.spec import submitting_python

        job.spec.python = submitting_python(os.environ)
    text = render(job, regenerate=_regen_command(args, command), templates=args.templates)
    sched = schedulers.get(job.cluster.scheduler)
    suffix = job.cluster.script_suffix
    runs_dir = Path(args.runs_dir)

    if args.dry_run:
        script = args.output or str(runs_dir / f"{job.name}-YYYYmmdd-HHMMSS" / f"job{suffix}")
        sys.stdout.write(text)
        sys.stdout.write(f"# submit: {shlex.join(sched.submit_command(script))}\n")
        return 0

    if "%" in str(runs_dir.resolve()) and sched.name == "slurm":
        raise UserError(f"--runs-dir: {str(runs_dir)!r} holds '%', which sbatch's --output "
                        "expands as a file-name pattern; allowed: a path without %")  # fmt: skip
    if args.resume:
        found = runs.find(args.resume, runs_dir)
        if found is None:
            raise UserError(f"resume: {args.resume!r} is not a run directory (no run.json); "
                            "allowed: a directory made by hpc submit, or its name under --runs-dir")
        run_dir = found[0]
    else:
        run_dir = runs.new_run_dir(runs_dir, job.name)
    # The job keeps its log in the run directory and learns where that is: the trainer's
    # default checkpoint folder is $HPC_RUN_DIR/checkpoints, so a requeued job resumes there.
    run_abs = str(run_dir.resolve())
    if sched.name != "local":
        job.spec.output_dir = run_abs
    job.spec.env = {**job.spec.env, "HPC_RUN_DIR": run_abs}
    text = render(job, regenerate=_regen_command(args, command), templates=args.templates)
    import yaml

    git = runs.git_info()
    with runs.locked(run_dir):  # concurrent --resume calls: names and history stay whole
        previous = runs.read_record(run_dir) if args.resume else None
        script = runs.create_free(run_dir, "job", suffix, text)
        runs.create_free(run_dir, "spec", ".yaml",
                         yaml.safe_dump(job.to_dict(), sort_keys=False, allow_unicode=True))  # fmt: skip
        argv = sched.submit_command(str(script))
        record: dict[str, Any] = {
            "name": job.name, "cluster": job.cluster.name, "scheduler": sched.name,
            "script": str(script), "spec": job.spec.source, "submit_command": shlex.join(argv),
            "cwd": os.getcwd(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "job_id": None,
            **git,
        }  # fmt: skip
        if previous is not None:  # earlier submissions of this run, oldest first
            earlier = previous.pop("submissions", [])
            record["submissions"] = [*earlier, previous]
        runs.write_record(run_dir, record)

    def started(job_id: str) -> None:  # a local run records its id before it ends
        runs.update_submission(run_dir, str(script), job_id=job_id, state="RUNNING")

    try:
        job_id = sched.submit(str(script), str(run_dir), on_start=started)
    except UserError as exc:
        runs.update_submission(run_dir, str(script), error=str(exc))
        raise
    changes: dict[str, Any] = {"job_id": job_id}
    code = 0
    if sched.name == "local":
        code = int(getattr(sched, "returncode", 0) or 0)
        changes.update(exit_code=code, state="COMPLETED" if code == 0 else "FAILED")
    runs.update_submission(run_dir, str(script), **changes)
    sys.stderr.write(f"run directory: {run_dir}\n")
    if sched.name != "local":
        sys.stdout.write(f"{job_id}\n")
    return code


def _locate(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """(job id, scheduler name, run record) for status and cancel."""
    from hpc import runs, schedulers

    if not args.id.strip() or any(c in args.id for c in ", \t\n"):
        raise UserError(f"id: {args.id!r}; allowed: one run directory, run name or job id")
    found = runs.find(args.id, Path(args.runs_dir))
    if found is not None:
        _, rec = found
        if not rec.get("job_id"):
            raise UserError(f"id: {args.id!r} names a run that has no job id (submit failed: "
                            f"{rec.get('error', 'unknown')})")
        return str(rec["job_id"]), str(rec["scheduler"]), rec
    if args.cluster:
        from hpc import cluster as clusters

        return args.id, clusters.load(args.cluster).scheduler, None
    name = schedulers.detect()
    if name is None:
        raise UserError(f"id: {args.id!r} is no run directory and neither squeue nor qstat is on PATH; "
                        "allowed: a run directory, or --cluster NAME")
    return args.id, name, None


def cmd_status(args: argparse.Namespace, command: list[str] | None) -> int:
    """Print ``JOBID STATE`` with the state normalized."""
    from hpc import schedulers

    job_id, sched_name, rec = _locate(args)
    if rec is not None and sched_name == "local" and rec.get("state") not in (None, "RUNNING"):
        state = str(rec["state"])
    else:
        state = schedulers.get(sched_name).status(job_id)
    sys.stdout.write(f"{job_id} {state}\n")
    return 0


def cmd_cancel(args: argparse.Namespace, command: list[str] | None) -> int:
    """Cancel the job through its scheduler."""
    from hpc import schedulers

    job_id, sched_name, _ = _locate(args)
    schedulers.get(sched_name).cancel(job_id)
    sys.stdout.write(f"{job_id} cancel requested\n")
    return 0


def _console() -> Any:
    """A rich console, 120 columns wide when output is not a terminal (pipes, tests)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=120)


def cmd_clusters(args: argparse.Namespace, command: list[str] | None) -> int:
    """A table of the cluster profiles."""
    from rich.table import Table

    from hpc import cluster as clusters
    from hpc._util import format_walltime

    table = Table(title="cluster profiles")
    for col in ("name", "scheduler", "devices/node", "ppn", "backend", "account", "queues"):
        table.add_column(col, no_wrap=col in ("name", "queues"))
    for c in clusters.load_all():
        queues = "\n".join(
            f"{q.name} {q.min_nodes}-{q.max_nodes} "
            + (format_walltime(q.max_walltime) if q.max_walltime else "")
            + (" (by size)" if q.bins else "")
            for q in c.queues.values()
        ) or "any"
        devices = f"{c.devices_per_node} {c.device}" if c.devices_per_node else c.device
        table.add_row(c.name, c.scheduler, devices, str(c.ppn), c.backend,
                      "required" if c.account_required else "optional", queues)
    _console().print(table)
    return 0


def cmd_doctor(args: argparse.Namespace, command: list[str] | None) -> int:
    """A found/missing table of what this machine has."""
    from rich.table import Table

    from hpc.doctor import rows

    table = Table(title="hpc doctor")
    for col in ("kind", "item", "status", "detail"):
        table.add_column(col)
    for kind, item, ok, detail in rows(probe_torch=not args.no_torch):
        table.add_row(kind, item, "[green]found[/]" if ok else "[yellow]missing[/]", detail)
    _console().print(table)
    return 0


def cmd_scale(args: argparse.Namespace, command: list[str] | None) -> int:
    """lr / warmup / effective batch for 1..N GPUs, doubling."""
    from rich.table import Table

    from hpc.scale import table as scale_table

    rows = scale_table(args.gpus, args.rule, args.base_lr, args.base_warmup, args.batch_size, args.accum,
                       args.base_gpus)
    tuned = f", base lr and warmup tuned at {args.base_gpus} GPUs" if args.base_gpus != 1 else ""
    table = Table(title=f"scaling rule {args.rule}: batch {args.batch_size} x accum {args.accum} per GPU{tuned}")
    for col in ("GPUs", "effective batch", "factor", "lr", "warmup"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.gpus), str(r.effective_batch), f"{r.factor:g}", f"{r.lr:.3g}", str(r.warmup))
    _console().print(table)
    return 0


def _fast_exit(code: int) -> None:
    """End the process without the interpreter's teardown.

    Tearing down the modules Jinja2 loads costs ~20 ms, a fifth of what ``hpc render``
    takes; render and dry runs hold no resources that need it (files are closed,
    nothing runs in the background), so flush the output and leave.
    """
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # a closed pipe (| head): nothing left to say
        code = code or 1
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hpc`` and ``python -m hpc``; returns the exit code."""
    as_program = argv is None
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
        code = int(args.func(args, command))
        if as_program and (args.command == "render" or getattr(args, "dry_run", False)):
            _fast_exit(code)
        return code
    except UserError as exc:
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
