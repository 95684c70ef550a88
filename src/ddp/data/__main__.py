"""``python -m ddp.data prepare-fasta IN.fasta[.gz] [--out DIR] [--force]`` and
``python -m ddp.data download-uniref50 [--url BASE] --to DIR`` (:mod:`ddp.data.download`).

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


def _progress_bar():
    """A rich bar on stderr: the terminal the callers check (``sys.stderr.isatty()``),
    leaving stdout to the one summary line a script may read."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=False,
        console=Console(stderr=True),
    )


def prepare(args: argparse.Namespace) -> int:
    src = Path(args.fasta)
    return prepare_into(src, Path(args.out) if args.out else default_out(src), args.force)


def prepare_into(src: Path, out: Path, force: bool, skip_current: bool = False) -> int:
    """``prepare-fasta SRC --out OUT``: the store, a progress bar on a terminal and one
    summary line. ``skip_current``: a store already made from SRC as it is now is kept
    (``download-uniref50`` run again), a stale one of ours replaced."""
    from ddp.data.fasta import PlainProgress, is_current, prepare_fasta
    from ddp.data.store import HEADER

    def note(text: str) -> None:
        print(f"ddp.data: note: {text}", file=sys.stderr)

    if skip_current and (out / HEADER).is_file():
        if is_current(out, src):
            print(f"{out}: already prepared from {src}")
            return 0
        force = True  # StoreWriter still replaces only a store ddp.data wrote
    t0 = time.perf_counter()
    if sys.stderr.isatty():
        with _progress_bar() as bar:
            task = bar.add_task(f"prepare {src.name}", total=None)

            def tick(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            store = prepare_fasta(src, out, tick, force=force, note=note)
    else:
        store = prepare_fasta(
            src, out, PlainProgress(lambda s: print(s, file=sys.stderr)), force=force, note=note
        )
    dt = time.perf_counter() - t0
    size = src.stat().st_size
    print(
        f"{out}: {store.n_seqs:,} sequences, {store.n_tokens:,} tokens from "
        f"{size / 1e6:,.1f} MB in {dt:.1f}s ({size / 1e6 / max(dt, 1e-9):,.0f} MB/s)"
    )
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
    f.set_defaults(run=prepare)
    d = sub.add_parser(
        "download-uniref50",
        help="UniRef50's FASTA from UniProt (resumable, size and MD5 checked), "
        "then prepare-fasta into --to",
    )
    d.add_argument(
        "--url",
        default=None,
        metavar="BASE",
        help="a folder laid out as UniProt's uniref/uniref50/ (default: UniProt's "
        "own, https://ftp.uniprot.org/pub/databases/uniprot/uniref/uniref50/)",
    )
    d.add_argument(
        "--to",
        required=True,
        metavar="DIR",
        help="where uniref50.fasta.gz and its store uniref50.fasta.gz.tokens go",
    )
    d.set_defaults(run=_download)
    from ddp.data.download import DownloadError

    args: argparse.Namespace | None = None
    try:
        args = p.parse_args(argv)
        return args.run(args)
    except ConfigError as exc:
        print(f"ddp.data: error: {exc}", file=sys.stderr)
        return 2
    except DownloadError as exc:
        print(f"ddp.data: error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as exc:  # ddp.data.store_write.Interrupted: SIGTERM, SIGHUP too
        signum = getattr(exc, "signum", signal.SIGINT)
        kept = (
            " (a download keeps only its .part, to resume)"
            if getattr(args, "run", None) is _download
            else ""
        )
        print(
            f"ddp.data: interrupted by {signal.Signals(signum).name}; no partial store is "
            f"left{kept}",
            file=sys.stderr,
        )
        return 128 + signum


def _download(args: argparse.Namespace) -> int:
    from ddp.data.download import DEFAULT_BASE, download_and_prepare

    return download_and_prepare(args.url or DEFAULT_BASE, Path(args.to))


if __name__ == "__main__":
    sys.exit(main())
