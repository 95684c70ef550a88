"""The handlers of ``hpc``'s job commands (render, submit/run, status, logs, cancel): each
takes the parsed flags and the command after ``--``, calls :mod:`hpc.core`, prints, and
returns the exit code. Also the flags turned into a spec's overrides, and the ``hpc
render`` line written into each script."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from hpc import core
from hpc._util import check_replaceable, read_regular, write_atomic
from hpc.errors import UserError

_OVERRIDES = (
    ("cluster", "--cluster"),
    ("nodes", "--nodes"),
    ("ppn", "--ppn"),
    ("walltime", "--walltime"),
    ("queue", "--queue"),
    ("account", "--account"),
    ("name", "--name"),
    ("gpus_per_node", "--gpus-per-node"),
    ("launcher", "--launcher"),
    ("wrap", "--wrap"),
)


# --- job building -------------------------------------------------------------------


def _env_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(
                f"--env: {item!r} is not NAME=VALUE; allowed: e.g. --env OMP_NUM_THREADS=4"
            )
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
    text = core.render_job(
        job, regenerate=_regen_command(args, command), templates=args.templates, script=args.output
    )
    seen = _job_sees(job)
    if seen:
        sys.stderr.write(seen)
    if args.output:
        out = Path(args.output)
        write_atomic(out, text, owner=core.RENDERED)
        sys.stderr.write(f"wrote {out}\n")
    else:
        sys.stdout.write(text)
    return 0


def _render_all(args: argparse.Namespace, command: list[str] | None) -> int:
    given = [flag for key, flag in _OVERRIDES if getattr(args, key) is not None]
    if given or command or args.spec or args.env or args.output:
        raise UserError(
            f"--all-jobs: renders the specs as they are; allowed: no spec, flags or command "
            f"(got {', '.join(given) or 'a spec or command'})"
        )
    rendered = core.render_all(Path(args.jobs_dir), args.templates)
    stale = [p for p, text in rendered.items() if _differs(p, text.encode("utf-8"))]
    if args.check:
        if stale:
            raise UserError(
                f"{', '.join(map(str, stale))}: out of date with the specs; "
                "allowed: regenerate with hpc render --all-jobs"
            )
        return 0
    for path in stale:  # every refusal before the first write: all or none replaced
        check_replaceable(path, "--all-jobs", core.RENDERED)
    for path in stale:
        write_atomic(path, rendered[path], "--all-jobs", owner=core.RENDERED)
        sys.stderr.write(f"wrote {path}\n")
    return 0


def _differs(path: Path, data: bytes) -> bool:
    """Whether the checked-in script at ``path`` is not ``data``, read as bytes and no
    further than one byte past ``data`` (a huge, non-UTF-8 or special file differs)."""
    try:
        return read_regular(path, "--all-jobs", len(data) + 1) != data
    except UserError:  # missing, a folder or a pipe (which render_all refuses anyway)
        return True


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
    plan = core.plan_submit(
        job,
        Path(args.runs_dir),
        resume=args.resume,
        regenerate=_regen_command(args, command),
        templates=args.templates,
        sweep=tasks,
        max_parallel=args.max_parallel,
        chain=chain,
        after=after,
    )
    _print_notes(plan, chain)
    if args.dry_run:
        _print_dry_run(plan, args.output)
        return 0
    done = core.submit(plan)
    sys.stderr.write(f"run directory: {done.run_dir}\n")
    if done.submission.exit_code is not None:  # ran here to the end
        return done.submission.exit_code
    sys.stdout.write(f"{done.submission.job_id}\n")
    if plan.chain > 1:
        sys.stderr.write(
            f"chain: {plan.chain} segments queued, each afterany the one before "
            f"(hpc status {done.run_dir} lists them)\n"
        )
    return 0


def _print_notes(plan: core.Plan, chain: int | None) -> None:
    """The plan's notes and the request's charge lines, on stderr: ``hpc submit``'s
    stdout stays the job id alone (scripts read it)."""
    from hpc.charges import balance_warning, max_charge_line

    j = plan.job
    for note in plan.notes:  # e.g. a sweep throttled to its queue's array limit
        sys.stderr.write(note + "\n")
    for line in (
        max_charge_line(j.cluster, j.nodes, j.walltime, j.queue),
        balance_warning(j.cluster, j.account, j.nodes, j.walltime, j.queue),
    ):
        if line:
            sys.stderr.write(line + "\n")
    if chain and chain > 1 and j.cluster.charge:
        sys.stderr.write(f"hpc: a chain of {chain} segments may use {chain} times that\n")


def _print_dry_run(plan: core.Plan, output: str | None) -> None:
    """``--dry-run``: the script, what the job will see, and every submit command in the
    order ``hpc submit`` would run them (a sweep split by MaxArraySize, a chain's segments)."""
    from hpc.chain import After

    argv = plan.scheduler.submit_command(output) if output else plan.argv
    sys.stdout.write(plan.text)
    sys.stdout.write(_job_sees(plan.job))
    sys.stdout.write(f"# submit: {shlex.join(argv)}\n")
    for k, (offset, count) in enumerate(plan.parts[1:], 2):
        prev = After(f"ARRAY{k - 1}", "any") if plan.job.max_parallel else plan.after
        then = plan.scheduler.array_part_command(
            str(plan.script), count, offset, plan.job.max_parallel, prev
        )
        sys.stdout.write(f"# then array {k}/{len(plan.parts)}: {shlex.join(then)}\n")
    for k in range(2, plan.chain + 1):
        then = plan.scheduler.submit_command(str(plan.script), After(f"SEGMENT{k - 1}", "any"))
        sys.stdout.write(f"# then segment {k}/{plan.chain}: {shlex.join(then)}\n")


def cmd_status(args: argparse.Namespace, command: list[str] | None) -> int:
    """Print ``JOBID STATE`` with the state normalized; a sweep adds a line per task
    (the job and its tasks are one scheduler query); a supervised run adds its restarts
    and excluded nodes; a failed job adds its failing rank's last lines on stderr
    (:mod:`hpc.failure`). ``--watch``: :mod:`hpc.watch`."""
    from hpc import runs, watch

    if getattr(args, "watch", False):
        return watch.run(
            args.id,
            Path(args.runs_dir),
            args.cluster,
            sys.stdout,
            sys.stderr,
            tty=sys.stdout.isatty(),
        )
    job_id, state, tasks = core.run_status(args.id, Path(args.runs_dir), args.cluster)
    sys.stdout.write(f"{job_id} {state}\n")
    for task_id, label, task_state in tasks:
        sys.stdout.write(f"{task_id} {task_state} {label}\n")
    found = runs.find(args.id, Path(args.runs_dir), history=True)
    restarts, excluded, stopped = watch.supervisor_events(found[1] if found else {})
    if restarts or excluded or stopped:  # on stderr: scripts read stdout's JOBID STATE lines
        sys.stderr.write(watch.supervisor_line(restarts, excluded, stopped) + "\n")
    if found and state == "FAILED":  # issue 31.2: the failing rank's last lines
        from hpc.status import failure_summary  # the lines --watch ends with, too

        for line in failure_summary(args.id, Path(args.runs_dir)):
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
        sys.stderr.write(
            f"hpc: {args.grep!r} found in {where}\n"
            if found
            else f"hpc: {args.grep!r} is in no rank's log\n"
        )
        return 0 if found else 1
    if args.rank is not None:
        if args.rank < 0:
            raise UserError(f"logs: --rank {args.rank}; allowed: a rank >= 0")
        if not logs.rank_logs(run_dir):  # no own files: the labelled lines of the job log
            if args.follow or args.err:
                raise UserError(
                    "logs: --rank with -f or --err needs per-rank files; allowed: "
                    "--rank alone for a job log with rank labels"
                )
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


def cmd_cancel(args: argparse.Namespace, command: list[str] | None) -> int:
    """Cancel the job through its scheduler."""
    job_id = core.cancel(args.id, Path(args.runs_dir), args.cluster)
    sys.stdout.write(f"{job_id} cancel requested\n")
    return 0
