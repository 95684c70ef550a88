"""Jinja2 environment, template lookup, the shell-quoting filters and the template sandbox.

What a template is given (:func:`context`, :func:`check_values`) is
:mod:`hpc.render_values`; the sandboxed environment it renders in (loader, sandbox,
filters, one-line errors) is :mod:`hpc.render_sandbox`; both re-exported here.

Templates are looked up per file, first match wins: ``--templates DIR``, then a
project-local ``./templates/``, then the built-in ones (installed as package data
``hpc/templates``, or the repository's ``templates/`` folder in a source tree). So a
project may override ``slurm.sh.j2`` alone and keep the other built-ins; a user
template reaches the built-in one of the same name as ``builtin/slurm.sh.j2``.

The environment uses ``StrictUndefined`` (a misspelt variable is an error, not an
empty string) and no autoescaping; user values reach the script only through the
``q`` filter (``shlex.quote``) or, in directives, after a character-set check.

Templates from a user's folder are files the user may not have written (a cloned
project's ``./templates``, picked up from the working directory), and plain Jinja runs
Python: ``{{ cycler.__init__.__globals__.os.system(...) }}``. So every template renders
in :class:`jinja2.sandbox.ImmutableSandboxedEnvironment`, which here also refuses to call
anything but Jinja's own helpers, macros and methods of plain values
(``job.scheduler.cancel(...)`` would run ``scancel``). The built-in ones too: measured
(in-process, 30 renders of ``pbs.sh.j2`` each, compiling included), the sandbox is no
slower (7.3-7.4 ms vs 7.8-8.2 ms a render; compiling dominates), so one environment
serves both. What the sandbox cannot bound (``{{ 'x' * 10**10 }}``, loops that print
nothing) is bounded by running the render in a child process (``fork``) with limits on
CPU time and memory, whenever a user folder is on the search path; the built-ins alone
render in-process, as the child adds a fork (~7 ms, measured alike) to ``hpc render``,
which docs/performance.md's bench times, and they are this project's own code, bounded by
review and golden tests. Every failure is one line naming the template file and line
(:func:`hpc.render_sandbox._one_line`), and a template taken from the working directory is named on
stderr once (:func:`_announce`).
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import UserError
from hpc.render_sandbox import (
    BUILTIN_PREFIX,
    MAX_TEMPLATE,
    USER_MEMORY,
    _environment,
    _one_line,
    _TemplateFailure,
    comment,
    quote,
)
from hpc.render_values import check_values, context

if TYPE_CHECKING:
    from hpc.job import Job

__all__ = [
    "BUILTIN_PREFIX",
    "MAX_SCRIPT",
    "MAX_TEMPLATE",
    "USER_CPU_S",
    "USER_MEMORY",
    "builtin_template_dir",
    "check_values",
    "comment",
    "context",
    "quote",
    "render",
    "render_template",
    "search_path",
]

_PKG = Path(__file__).resolve().parent
_LOG = logging.getLogger(__name__)

MAX_SCRIPT = 4 << 20
"""Largest rendered script, in characters: SLURM's default ``max_script_size`` (4 MB);
a bigger one is a template that loops, and no scheduler would take it."""
USER_CPU_S = 10
"""CPU seconds a render with user templates may take (the child's RLIMIT_CPU); a real one
takes milliseconds, so this is a bound against a loop, not a budget."""
_ANNOUNCED: set[str] = set()  # user templates from the working directory named on stderr


def builtin_template_dir() -> Path:
    """The installed package data, else the source tree's ``templates/`` folder."""
    for candidate in (_PKG / "templates", _PKG.parent / "templates"):
        if (candidate / "slurm.sh.j2").is_file():
            return candidate
    try:  # an unusual install layout: ask the import system
        from importlib.resources import files

        return Path(str(files("hpc.templates")))
    except (ImportError, TypeError):  # pragma: no cover - broken install
        raise UserError(
            "templates: the built-in templates are missing; reinstall hpc-ddp"
        ) from None


def _folders(templates: str | Path | None, cwd: Path | None) -> tuple[list[str], str | None, str]:
    """(search path highest precedence first, the working directory's folder, the built-in one)."""
    dirs: list[Path] = []
    if templates is not None:
        t = Path(templates)
        if not t.is_dir():
            raise UserError(f"templates: {str(t)!r} is not a directory; allowed: a folder of *.j2")
        dirs.append(t)
    local = (Path.cwd() if cwd is None else cwd) / "templates"
    if local.is_dir():
        dirs.append(local)
    builtin = str(builtin_template_dir().resolve())
    seen: list[str] = []
    for d in [*dirs, Path(builtin)]:
        s = str(d.resolve())
        if s not in seen:
            seen.append(s)
    here = str(local.resolve()) if local.is_dir() else None
    return seen, (here if here != builtin else None), builtin


def search_path(templates: str | Path | None = None, cwd: Path | None = None) -> list[str]:
    """Template directories, highest precedence first."""
    return _folders(templates, cwd)[0]


def render(
    job: Job,
    regenerate: str | None = None,
    templates: str | Path | None = None,
    cwd: Path | None = None,
    script: str | None = None,
) -> str:
    """The job script for ``job``, from the template its scheduler names."""
    return render_template(job.scheduler.template, context(job, regenerate, script), templates, cwd)


def render_template(
    name: str, values: dict[str, Any], templates: str | Path | None = None, cwd: Path | None = None
) -> str:
    """Template ``name`` rendered with ``values``: the one way this project renders.

    The built-in templates alone render here; with a user's folder on the search path
    the render is sandboxed and runs in a child process with bounded CPU and memory
    (:func:`_render_child`). Every failure is one :class:`UserError` line naming the
    template file and line.
    """
    dirs, here, builtin = _folders(templates, cwd)
    if dirs == [builtin] or not hasattr(os, "fork"):
        text, used = _render_here(dirs, builtin, name, values)
    else:
        text, used = _render_child(dirs, builtin, name, values)
    _announce(used, here)
    return text


def _render_here(
    dirs: list[str], builtin: str, name: str, values: dict[str, Any]
) -> tuple[str, list[str]]:
    """(the text, the user template files it used), the output bounded by MAX_SCRIPT."""
    env = _environment(dirs, builtin)
    try:
        pieces = env.get_template(name).generate(values)
        out: list[str] = []
        size = 0
        for piece in pieces:
            out.append(piece)
            size += len(piece)
            if size > MAX_SCRIPT:  # raised at the template's yield: its line is known
                pieces.throw(
                    _TemplateFailure(
                        f"renders more than {MAX_SCRIPT >> 20} MiB (an endless loop?); allowed: a "
                        "job script (SLURM's default max_script_size is 4 MB)"
                    )
                )
    except Exception as exc:
        message = _one_line(exc, name, env.loader)
        if message is None:
            raise  # a bug in the project's own templates or filters: keep the traceback
        raise UserError(message) from None
    return "".join(out), [f for f, d in env.loader.files.items() if d != builtin]


def _render_child(
    dirs: list[str], builtin: str, name: str, values: dict[str, Any]
) -> tuple[str, list[str]]:
    """:func:`_render_here` in a forked child with RLIMIT_CPU and RLIMIT_AS set.

    Why a process: the sandbox stops Python escapes, but not ``{{ 'x' * 10**10 }}`` or
    two nested loops of 100,000 that print nothing; only the kernel bounds those
    without slowing every render. The child answers one JSON document on a pipe:
    the text and files used, or the one-line error; a child the kernel ends says so.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (coverage does not follow a fork)
        code = 0
        try:
            os.close(read_fd)
            _limit_child()
            try:
                text, used = _render_here(dirs, builtin, name, values)
                reply: dict[str, Any] = {"text": text, "used": used}
            except UserError as exc:
                reply = {"error": str(exc)}
            except BaseException:  # a bug: its traceback, for the parent to raise
                reply = {"bug": traceback.format_exc()}
            view = memoryview(json.dumps(reply).encode("utf-8"))
            while view:
                view = view[os.write(write_fd, view) :]
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks: list[bytes] = []
    total = 0
    try:
        while chunk := os.read(read_fd, 1 << 20):
            chunks.append(chunk)
            total += len(chunk)
            if total > 8 * MAX_SCRIPT:  # JSON of MAX_SCRIPT characters is less than this
                os.kill(pid, 9)
                break
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError:
        why = (
            f"was ended by signal {os.WTERMSIG(status)}"
            if os.WIFSIGNALED(status)
            else f"exited {os.WEXITSTATUS(status)}"
        )
        raise UserError(
            f"templates: rendering {name} {why} (past its bounds: {USER_CPU_S} s of "
            f"CPU, {USER_MEMORY >> 20} MiB of memory, {MAX_SCRIPT >> 20} MiB of "
            "output); allowed: a template that renders a job script"
        ) from None
    if "error" in reply:
        raise UserError(reply["error"])
    if "bug" in reply:
        raise RuntimeError(f"rendering {name} failed in the child process:\n{reply['bug']}")
    return reply["text"], reply["used"]


def _limit_child() -> None:  # pragma: no cover - runs in the child
    """CPU seconds and memory for this (child) process; past the CPU bound the template
    gets an exception where it is, so the message names its line."""
    import resource
    import signal

    def out_of_cpu(signum: int, frame: Any) -> None:
        raise _TemplateFailure(
            f"still running after {USER_CPU_S} s of CPU (an endless loop?); "
            "allowed: a template that renders a job script"
        )

    signal.signal(signal.SIGXCPU, out_of_cpu)
    resource.setrlimit(resource.RLIMIT_CPU, (USER_CPU_S, USER_CPU_S + 2))
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            size = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = size + USER_MEMORY
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft == resource.RLIM_INFINITY or limit < soft:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (OSError, ValueError):  # no /proc (not Linux): CPU and output bounds only
        pass


def _announce(used: list[str], here: str | None) -> None:
    """Name on stderr, once a process, each template taken from the working directory:
    a render should not change silently with the folder it runs in."""
    if here is None:
        return
    for path in used:
        if path.startswith(here + os.sep) and path not in _ANNOUNCED:
            _ANNOUNCED.add(path)
            _LOG.warning(
                "templates: using %s from the working directory's templates/ "
                "(rendered in the sandbox)",
                path,
            )
