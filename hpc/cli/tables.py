"""The handlers of ``hpc``'s commands that print through rich (report, clusters, doctor,
scale), and the console they share. rich is imported inside each, so the job commands
(:mod:`hpc.cli.commands`) never load it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def cmd_report(args: argparse.Namespace, command: list[str] | None) -> int:
    """Plot the runs' metrics into a PNG and print a summary table."""
    from rich.text import Text

    from hpc import fingerprint
    from hpc.report import report

    console = _console()
    report(
        [Path(d) for d in args.run_dirs],
        Path(args.output) if args.output else None,
        console=console,
    )
    for run_dir in args.run_dirs:  # what ran, and what changed since the last submission
        for line in fingerprint.describe(Path(run_dir)):
            console.print(Text(line))
    from hpc.charges import used_lines

    for run_dir in args.run_dirs:  # node-hours each submission used, and their total
        for line in used_lines(Path(run_dir)):
            console.print(Text(line))
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
        queues = (
            "\n".join(
                f"{q.name} {q.min_nodes}-{q.max_nodes} "
                + (format_walltime(q.max_walltime) if q.max_walltime else "")
                + (" (by size)" if q.bins else "")
                for q in c.queues.values()
            )
            or "any"
        )
        devices = f"{c.devices_per_node} {c.device}" if c.devices_per_node else c.device
        table.add_row(
            c.name,
            c.scheduler,
            devices,
            str(c.ppn),
            "required" if c.account_required else "optional",
            queues,
        )
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

    rows = scale_table(
        args.gpus,
        args.rule,
        args.base_lr,
        args.base_warmup,
        args.batch_size,
        args.accum,
        args.base_gpus,
        by=args.by,
        base_batch=args.base_batch,
    )
    tuned = f", base lr and warmup tuned at {args.base_gpus} GPUs" if args.base_gpus != 1 else ""
    if args.by == "batch":
        tuned = f", base lr and warmup tuned at effective batch {args.base_batch}"
    table = Table(
        title=f"scaling rule {args.rule}: batch {args.batch_size} x accum {args.accum} per GPU{tuned}"
    )
    for col in ("GPUs", "effective batch", "factor", "lr", "warmup"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.gpus), str(r.effective_batch), f"{r.factor:g}", f"{r.lr:.3g}", str(r.warmup)
        )
    _console().print(table)
    return 0
