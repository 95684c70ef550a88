"""Jinja2 environment, template lookup, the shell-quoting filters and the template sandbox.

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
(:func:`_one_line`), and a template taken from the working directory is named on
stderr once (:func:`_announce`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shlex
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc._util import (
    directive_line,
    directive_value,
    format_walltime,
    read_regular,
    variable_name,
)
from hpc.errors import UserError

if TYPE_CHECKING:
    from hpc.job import Job

_PKG = Path(__file__).resolve().parent
_LOG = logging.getLogger(__name__)
_SAID: set[str] = set()  # rank-layout notes already said in this process (hpc.cluster.Layout)

MAX_TEMPLATE = 1 << 20
"""Largest template file read (a real one is a few kilobytes)."""
MAX_SCRIPT = 4 << 20
"""Largest rendered script, in characters: SLURM's default ``max_script_size`` (4 MB);
a bigger one is a template that loops, and no scheduler would take it."""
USER_CPU_S = 10
"""CPU seconds a render with user templates may take (the child's RLIMIT_CPU); a real one
takes milliseconds, so this is a bound against a loop, not a budget."""
USER_MEMORY = 1 << 30
"""Memory a render with user templates may add to the process (the child's RLIMIT_AS)."""
BUILTIN_PREFIX = "builtin/"
"""``{% extends "builtin/slurm.sh.j2" %}``: the built-in template, whatever overrides it."""

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
        raise UserError("templates: the built-in templates are missing; reinstall hpc-ddp") from None


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


def quote(value: Any) -> str:
    """The Jinja ``q`` filter: one shell word, whatever the value holds."""
    return shlex.quote(str(value))


def comment(value: Any) -> str:
    """Text safe inside a ``#`` comment line: line breaks shown as ``\\n``."""
    return str(value).replace("\r", "\\r").replace("\n", "\\n")


class _TemplateFailure(Exception):
    """Raised inside a render (output or CPU past its bound) so that the template's line
    is in the traceback; :func:`_one_line` words it."""


_VALUES = (str, int, float, complex, bool, bytes, tuple, list, dict, set, frozenset, type(None))


@functools.cache
def _jinja() -> Any:
    """Jinja2 and the two classes of this module built over it (imported on first render:
    ``import hpc.render`` stays free of Jinja)."""
    import types

    import jinja2
    from jinja2.loaders import split_template_path
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Loader(jinja2.BaseLoader):
        """The search path, first match wins; ``builtin/NAME`` is the built-in folder's.

        A file is untrusted input: read by :func:`hpc._util.read_regular` (a named pipe
        would block a plain open), bounded, and UTF-8 or one line naming its line. Each
        file read is kept with its folder, for errors and for :func:`_announce`.
        """

        def __init__(self, dirs: list[str], builtin: str) -> None:
            self.dirs, self.builtin = dirs, builtin
            self.files: dict[str, str] = {}

        def get_source(self, environment: Any, template: str) -> tuple[str, str, None]:
            dirs, name = self.dirs, template
            if template.startswith(BUILTIN_PREFIX):
                dirs, name = [self.builtin], template[len(BUILTIN_PREFIX):]
            pieces = split_template_path(name)  # TemplateNotFound for '..'
            for folder in dirs:
                path = os.path.join(folder, *pieces)
                if not os.path.lexists(path):  # a dangling link or a pipe is refused, not skipped
                    continue
                data = read_regular(Path(path), "templates", MAX_TEMPLATE)
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    line = data.count(b"\n", 0, exc.start) + 1
                    raise UserError(f"templates: {path} line {line}: not UTF-8 text (byte "
                                    f"{exc.start}); allowed: a UTF-8 Jinja template") from None
                self.files[path] = folder
                return text, path, None
            raise jinja2.TemplateNotFound(template)

    class Sandbox(ImmutableSandboxedEnvironment):
        """Jinja's immutable sandbox, calling only what cannot act on the world.

        The sandbox alone refuses ``_`` attributes and mutating methods but would call
        any public method of the context's objects: ``job.scheduler.submit(...)`` runs
        ``sbatch``. Here only the environment's globals (``range``, ``dict``, ...), Jinja's
        own objects (macros, ``loop.cycle``, ``super()``) and methods of plain values
        (``'a,b'.split(',')``) may be called; data is read, never behaviour.
        """

        def is_safe_callable(self, obj: Any) -> bool:
            if not super().is_safe_callable(obj):
                return False
            if any(obj is g for g in self.globals.values()):
                return True
            if isinstance(obj, (types.MethodType, types.BuiltinMethodType)):
                owner = obj.__self__
                return isinstance(owner, _VALUES) or _of_jinja(type(owner))
            if isinstance(obj, types.FunctionType):  # str.format, wrapped by the sandbox
                return str(obj.__module__).partition(".")[0] == "jinja2"
            return _of_jinja(type(obj))

        def join_path(self, template: str, parent: str) -> str:
            if template == parent:  # ./templates/X extending X finds itself, forever
                raise jinja2.TemplateRuntimeError(
                    f"{parent!r} names itself; allowed: '{BUILTIN_PREFIX}{parent}' for the "
                    "built-in template of that name")
            return template

    return types.SimpleNamespace(jinja2=jinja2, Loader=Loader, Sandbox=Sandbox)


def _of_jinja(cls: type) -> bool:
    return str(cls.__module__).partition(".")[0] == "jinja2"


def _environment(dirs: list[str], builtin: str) -> Any:
    """The sandboxed Jinja2 environment over ``dirs`` (see the module's docstring)."""
    jinja = _jinja()
    env = jinja.Sandbox(
        loader=jinja.Loader(dirs, builtin),
        undefined=jinja.jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = quote
    env.filters["comment"] = comment
    env.filters["walltime"] = format_walltime
    return env



def context(job: Job, regenerate: str | None = None, script: str | None = None) -> dict[str, Any]:
    """Everything a template may use; the templates decide only the layout.

    The scheduler adds its own values (``Scheduler.template_values``: numbers computed
    here, not in Jinja) and variables (``Scheduler.job_env``; the spec's own win).
    """
    from hpc.launchers import Raw, python_of, sh_join

    spec, cluster, scheduler = job.spec, job.cluster, job.scheduler
    preamble, launch = scheduler.launch(job)
    if spec.resilience:  # the launch under ddp.supervise (hpc.launchers.supervised)
        from hpc.launchers import supervised

        launch = supervised(job, launch)
    sweep = None
    if job.array_size:  # each array task appends its own --set overrides (hpc.sweep)
        launch = [*launch, Raw('"${HPC_SWEEP_ARGS[@]}"')]
        sweep = {"python": python_of(spec.command), "index_var": scheduler.array_index_var,
                 "last": job.array_size - 1, "offset_arg": scheduler.array_parts,
                 "offset_word": scheduler.array_offset_word}
    # device_order first: a spec's own CUDA_VISIBLE_DEVICES still wins
    layout = cluster.layout(job.ppn)  # one rank per GPU or per tile (hpc.cluster.Tiles)
    if layout.note and layout.note not in _SAID:  # said once per process, not per render
        _SAID.add(layout.note)
        _LOG.warning("hpc: %s", layout.note)
    env = {**cluster.device_order_env(), **cluster.env, **layout.env, **spec.env}
    for key, value in scheduler.job_env(job).items():
        env.setdefault(key, value)
    if spec.per_rank_logs:  # ddp.init sends each rank's output to RUN/ranks/rank-NNNNN.log
        env.setdefault("DDP_RANK_LOGS", "1")
    applied = cluster.apply_rules(job.nodes, env, frozenset(spec.env))  # the site's known issues
    env = applied.env
    for line in applied.warnings:
        if line not in _SAID:
            _SAID.add(line)
            _LOG.warning("hpc: %s", line)
    check_values(job, env)
    source = spec.source or "command-line flags"
    return {
        "job": job,
        "spec": spec,
        "cluster": cluster,
        "name": job.name,
        "header": f"Generated by hpc render from {source}"
        + (f"; regenerate: {regenerate}" if regenerate else ""),
        "walltime": format_walltime(job.walltime),
        "module_use": list(cluster.module_use),
        "modules": [*cluster.modules, *spec.modules],
        "site_setup": list(cluster.setup),
        "setup": list(spec.setup),
        # ``python: site`` (no environment of ours) renders like no ``python:`` at all
        "python": spec.python if isinstance(spec.python, dict) else {},
        # {conda: ENV}: the conda whose shell hook activates it (a name: the job's PATH's)
        "conda": _conda_of(spec.python),
        "env": env,
        "unset": list(applied.unset),  # after the exports: a module may set them too
        # env_prepend: (VAR, 'dir') per directory, each put in front of $VAR in turn
        "env_prepend": [(var, quote(d)) for var, dirs in cluster.env_prepend.items() for d in dirs],
        "shell": cluster.shell,
        "queue_directive": cluster.queue_directive_for(job.queue),
        "site_directives": cluster.site_directives(job.queue),
        "queue_notes": cluster.queue_notes(job.queue),
        "preamble": preamble,
        "script": script or "SCRIPT",
        "launch": sh_join(launch),
        "sweep": sweep,
        "chain": job.chain,
        # the venv copied to each node first (hpc.stage); replaces its activation
        "stage_lines": scheduler.stage_lines(job, job.stage) if job.stage else [],
        **scheduler.template_values(job),
    }


def check_values(job: Job, env: dict[str, str]) -> None:
    """The last gate before a script: every value that reaches a ``#SBATCH``/``#PBS`` line,
    the ``#!`` line or an unquoted ``export NAME=``, checked by the rule of its kind.

    Profiles and specs are checked as they load (naming their file), with the same
    rules (:func:`hpc._util.directive_value`, :func:`~hpc._util.directive_line`,
    :func:`~hpc._util.variable_name`); a Cluster or JobSpec made in Python, or the run
    directory from ``--runs-dir`` (the log folder in ``--output``/``-o``), arrive here
    unchecked. Quoting cannot help in a directive: the scheduler reads the line itself.
    """
    spec, cluster = job.spec, job.cluster
    words = {"name": job.name, "queue": job.queue, "account": job.account,
             "filesystems": job.filesystems, "signal": spec.signal, "system": cluster.system,
             "place": cluster.place, "constraint": cluster.constraint}
    for field, value in words.items():
        if value is not None:
            directive_value(value, field)
    for field in ("nodes", "ppn", "walltime", "gpus_per_node", "cpus_per_task", "array_size",
                  "max_parallel"):  # written unquoted: numbers, as resolve() makes them
        value = getattr(job, field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise UserError(f"{field}: {value!r} is not allowed; allowed: a whole number")
    directive_line(cluster.shell, "shell")
    directive_line(spec.output_dir, "output_dir (the folder of the job's log)")
    for line in (*cluster.site_directives(job.queue), *spec.directives):
        directive_line(line, "directives")
    for line in cluster.queue_notes(job.queue):
        directive_line(line, "notes")
    for key in (*env, *cluster.env_prepend):
        variable_name(key, "env")


def _conda_of(python: Any) -> str | None:
    """The conda program for ``{conda: ENV}``: ENV's own for a path, else ``conda``."""
    from hpc.spec import conda_executable

    if not isinstance(python, dict) or "conda" not in python:
        return None
    env = str(python["conda"])
    return (conda_executable(env) if "/" in env else None) or "conda"


def render(
    job: Job, regenerate: str | None = None, templates: str | Path | None = None,
    cwd: Path | None = None, script: str | None = None,
) -> str:
    """The job script for ``job``, from the template its scheduler names."""
    return render_template(job.scheduler.template, context(job, regenerate, script), templates, cwd)


def render_template(name: str, values: dict[str, Any], templates: str | Path | None = None,
                    cwd: Path | None = None) -> str:
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


def _render_here(dirs: list[str], builtin: str, name: str,
                 values: dict[str, Any]) -> tuple[str, list[str]]:
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
                pieces.throw(_TemplateFailure(
                    f"renders more than {MAX_SCRIPT >> 20} MiB (an endless loop?); allowed: a "
                    "job script (SLURM's default max_script_size is 4 MB)"))
    except Exception as exc:
        message = _one_line(exc, name, env.loader)
        if message is None:
            raise  # a bug in the project's own templates or filters: keep the traceback
        raise UserError(message) from None
    return "".join(out), [f for f, d in env.loader.files.items() if d != builtin]


def _one_line(exc: BaseException, name: str, loader: Any) -> str | None:
    """The error as one line naming the template file and line; None for a bug in ours."""
    jinja2 = _jinja().jinja2
    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return _flat(f"templates: {exc.filename or name} line {exc.lineno}: {exc.message}")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in loader.files]
    where = f"{frames[-1].filename} line {frames[-1].lineno}" if frames else name
    user = bool(frames) and loader.files[frames[-1].filename] != loader.builtin
    if isinstance(exc, jinja2.TemplateNotFound):
        what = f"{exc.name!r} not found" if frames else "not found"
        return _flat(f"templates: {where}: {what} in {', '.join(loader.dirs)}; allowed: a "
                     f"template in those folders, or {BUILTIN_PREFIX}NAME for a built-in one")
    if isinstance(exc, jinja2.UndefinedError):
        return _flat(f"templates: {where}: {exc.message}; allowed: the variables of "
                     "hpc.render.context")
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return _flat(f"templates: {where}: {str(exc).rstrip('.')}; allowed in a template: "
                     "the context's values, Jinja's own helpers and macros, methods of text "
                     "and numbers")
    if isinstance(exc, (jinja2.TemplateRuntimeError, _TemplateFailure)):
        return _flat(f"templates: {where}: {exc}")
    if isinstance(exc, RecursionError):
        return _flat(f"templates: {where}: nested too deeply (templates that include or extend "
                     "each other?); allowed: a chain of templates that ends")
    if isinstance(exc, MemoryError):
        return _flat(f"templates: {where}: needs more than {USER_MEMORY >> 20} MiB of memory; "
                     "allowed: a template that renders a job script")
    if user:
        return _flat(f"templates: {where}: {type(exc).__name__}: {exc}")
    return None


def _flat(text: str) -> str:
    """One line: an exception's own text may hold line breaks."""
    return " ".join(text.split())


def _render_child(dirs: list[str], builtin: str, name: str,
                  values: dict[str, Any]) -> tuple[str, list[str]]:
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
                view = view[os.write(write_fd, view):]
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
        why = (f"was ended by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exited {os.WEXITSTATUS(status)}")
        raise UserError(f"templates: rendering {name} {why} (past its bounds: {USER_CPU_S} s of "
                        f"CPU, {USER_MEMORY >> 20} MiB of memory, {MAX_SCRIPT >> 20} MiB of "
                        "output); allowed: a template that renders a job script") from None
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
        raise _TemplateFailure(f"still running after {USER_CPU_S} s of CPU (an endless loop?); "
                               "allowed: a template that renders a job script")

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
            _LOG.warning("templates: using %s from the working directory's templates/ "
                         "(rendered in the sandbox)", path)
