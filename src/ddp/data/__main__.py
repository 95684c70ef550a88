"""``python -m ddp.data prepare-fasta IN.fasta[.gz] [--out DIR] [--force]``.

Runs anywhere numpy is installed (a login node before the job). The store goes to
``--out`` or beside the input (``IN.fasta.tokens``), where the uniref50 recipe looks
for it. A progress bar with MB/s on a terminal (rich), plain lines in a batch log.
Mistakes end with one ``ddp.data: error:`` line and exit code 2, leaving no store;
SIGTERM, SIGHUP and SIGINT end with one line and 128 + the signal's number, leaving
no temporary store either.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ddp.errors import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def default_out(fasta: Path) -> Path:
    """Where a FASTA's store lives unless told otherwise: beside it."""
    return fasta.with_name(fasta.name + ".tokens")


def _progress_bar():  # noqa: ANN202 - rich types stay lazy
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), transient=False)  # fmt: skip


def prepare(args: argparse.Namespace) -> int:
    from ddp.data.fasta import PlainProgress, prepare_fasta

    def note(text: str) -> None:
        print(f"ddp.data: note: {text}", file=sys.stderr)

    src = Path(args.fasta)
    out = Path(args.out) if args.out else default_out(src)
    t0 = time.perf_counter()
    if sys.stderr.isatty():
        with _progress_bar() as bar:
            task = bar.add_task(f"prepare {src.name}", total=None)

            def tick(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            store = prepare_fasta(src, out, tick, force=args.force, note=note)
    else:
        store = prepare_fasta(src, out, PlainProgress(lambda s: print(s, file=sys.stderr)),
                              force=args.force, note=note)  # fmt: skip
    dt = time.perf_counter() - t0
    size = src.stat().st_size
    print(f"{out}: {store.n_seqs:,} sequences, {store.n_tokens:,} tokens from "
          f"{size / 1e6:,.1f} MB in {dt:.1f}s ({size / 1e6 / max(dt, 1e-9):,.0f} MB/s)")  # fmt: skip
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command; 141, quietly, once nobody reads its output (``ddp._pipes``)."""
    from ddp._pipes import run_main

    return run_main(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = _Parser(prog="python -m ddp.data", description="Prepare token stores.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    f = sub.add_parser("prepare-fasta", help="tokenize a FASTA file (gzip too) into a store")
    f.add_argument("fasta", help="input FASTA (.fasta, .fa, .gz)")
    f.add_argument("--out", help="store directory (default: beside the input, IN.tokens)")
    f.add_argument("--force", action="store_true", help="replace an existing store")
    try:
        args = p.parse_args(argv)
        return prepare(args)
    except ConfigError as exc:
        print(f"ddp.data: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # ddp.data.store.Interrupted: SIGTERM, SIGHUP too
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"ddp.data: interrupted by {signal.Signals(signum).name}; no partial store is "
              "left", file=sys.stderr)  # fmt: skip
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
