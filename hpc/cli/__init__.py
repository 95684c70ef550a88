"""The ``hpc`` command: argument parsing and printing over the library in ``hpc.core``.

Commands: render, submit, run, status, cancel, clusters, doctor, scale. Every
expected failure (``hpc.errors.HpcError``) becomes one stderr line ``hpc: error: ...``
with its exit code: 2 for a user mistake, 3 for a scheduler that failed or could not
be reached; ``--debug`` adds the traceback. ``render`` and ``submit --dry-run`` import
neither torch, submitit nor rich, so they answer in a few tens of milliseconds.
Nothing but ``hpc.__main__`` imports this package.

The command to run comes after ``--``: ``hpc render --cluster aurora -- python train.py``.

The parser is :mod:`hpc.cli.parser`; the job commands' handlers :mod:`hpc.cli.commands`;
those printing rich tables :mod:`hpc.cli.tables`. This module is the entry point.
"""

from __future__ import annotations

import errno
import os
import sys

from hpc._util import MAX_COUNT
from hpc.cli.commands import cmd_cancel, cmd_logs, cmd_render, cmd_status, cmd_submit
from hpc.cli.parser import COMMANDS, build_parser
from hpc.cli.tables import cmd_clusters, cmd_doctor, cmd_report, cmd_scale
from hpc.errors import HpcError, UserError

__all__ = [
    "COMMANDS",
    "MAX_COUNT",
    "build_parser",
    "cmd_cancel",
    "cmd_clusters",
    "cmd_doctor",
    "cmd_logs",
    "cmd_render",
    "cmd_report",
    "cmd_scale",
    "cmd_status",
    "cmd_submit",
    "main",
]


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

            raise UserError(
                f"command: {wanted!r} is not a command{did_you_mean(wanted, COMMANDS)}; "
                f"allowed: {', '.join(COMMANDS)}"
            )
        parser = build_parser(wanted)
        args = parser.parse_args(argv)
        if args.command is None:
            raise UserError(f"command: missing; allowed: {', '.join(COMMANDS)}")
        if command is not None and args.command not in ("render", "submit", "run"):
            raise UserError(f"--: {args.command} takes no command after --")
        if args.command in ("render", "submit", "run"):
            _utf8_words(argv + (command or []))
        if sys.stdout is None and args.command != "run":  # >&-: what it prints is lost
            raise UserError(
                "standard output is closed; allowed: a terminal, file or pipe "
                "(>/dev/null to discard it; hpc run keeps the job's output in its log)"
            )
        return int(args.func(args, command))
    except HpcError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        sys.stderr.write(f"hpc: error: {exc}\n")
        return int(getattr(exc, "exit_code", 2))
    except OSError as exc:
        line = _path_refused(exc)
        if line is None or debug:
            raise
        sys.stderr.write(f"hpc: error: {line}\n")
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    except KeyboardInterrupt:
        sys.stderr.write("hpc: interrupted\n")
        return 130


def _utf8_words(words: list[str]) -> None:
    """Refuse a word that came from bytes that are not UTF-8 (Python keeps such bytes as
    lone surrogates): the commands that write a job script and its run's records write
    UTF-8 text, and one such word would stop them half-way with a run folder made."""
    for word in words:
        try:
            word.encode("utf-8")
        except UnicodeEncodeError as exc:
            shown = os.fsencode(word).decode("utf-8", "backslashreplace")
            raise UserError(
                f"argument '{shown}' is not UTF-8 text (at character {exc.start + 1}); "
                "allowed: UTF-8 (a job script and its run's records are UTF-8 text)"
            ) from None


#: What the system says of a path a user gave (too long, a loop of links, a file where a
#: folder should be, no permission, a read-only file system): every command that takes
#: a path may meet one anywhere it touches it, so it is worded here, once.
_PATH_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENAMETOOLONG", "ELOOP", "ENOTDIR", "EACCES", "EPERM", "EROFS", "EISDIR")
)


def _path_refused(exc: OSError) -> str | None:
    """One line for a path the system refused, naming the path (cut to 80 characters);
    None for any other error, which is no user's mistake and keeps its traceback."""
    if exc.errno not in _PATH_ERRNOS or exc.filename is None:
        return None
    name = os.fsdecode(exc.filename) if isinstance(exc.filename, bytes) else str(exc.filename)
    shown = name if len(name) <= 80 else f"{name[:77]}..."
    return f"path {shown!r}: {exc.strerror}; allowed: a path this system can open"
