"""The sandboxed Jinja2 environment every template renders in, and its one-line errors.

:mod:`hpc.render` looks templates up and renders them (in-process for the built-ins,
in a bounded child process with a user's folder on the search path); this module is
what that render runs in: the loader (each file read as untrusted input), the
immutable sandbox that calls nothing but Jinja's own helpers and methods of plain
values (see :mod:`hpc.render`'s docstring for why), the filters (``q``, ``comment``,
``walltime``) and :func:`_one_line`, which words any failure as one line naming the
template file and line. Jinja is imported on the first render, not with this module.
"""

from __future__ import annotations

import functools
import os
import shlex
import traceback
from pathlib import Path
from typing import Any

from hpc._util import format_walltime, read_regular
from hpc.errors import UserError

MAX_TEMPLATE = 1 << 20
"""Largest template file read (a real one is a few kilobytes)."""
USER_MEMORY = 1 << 30
"""Memory a render with user templates may add to the process (the child's RLIMIT_AS)."""
BUILTIN_PREFIX = "builtin/"
"""``{% extends "builtin/slurm.sh.j2" %}``: the built-in template, whatever overrides it."""


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
    ``import hpc.render`` stays free of Jinja). Over 60 lines because both classes are
    defined inside it: they subclass Jinja's, which only this function imports."""
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
                dirs, name = [self.builtin], template[len(BUILTIN_PREFIX) :]
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
                    raise UserError(
                        f"templates: {path} line {line}: not UTF-8 text (byte "
                        f"{exc.start}); allowed: a UTF-8 Jinja template"
                    ) from None
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
                    "built-in template of that name"
                )
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
        return _flat(
            f"templates: {where}: {what} in {', '.join(loader.dirs)}; allowed: a "
            f"template in those folders, or {BUILTIN_PREFIX}NAME for a built-in one"
        )
    if isinstance(exc, jinja2.UndefinedError):
        return _flat(
            f"templates: {where}: {exc.message}; allowed: the variables of hpc.render.context"
        )
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return _flat(
            f"templates: {where}: {str(exc).rstrip('.')}; allowed in a template: "
            "the context's values, Jinja's own helpers and macros, methods of text "
            "and numbers"
        )
    if isinstance(exc, (jinja2.TemplateRuntimeError, _TemplateFailure)):
        return _flat(f"templates: {where}: {exc}")
    if isinstance(exc, RecursionError):
        return _flat(
            f"templates: {where}: nested too deeply (templates that include or extend "
            "each other?); allowed: a chain of templates that ends"
        )
    if isinstance(exc, MemoryError):
        return _flat(
            f"templates: {where}: needs more than {USER_MEMORY >> 20} MiB of memory; "
            "allowed: a template that renders a job script"
        )
    if user:
        return _flat(f"templates: {where}: {type(exc).__name__}: {exc}")
    return None


def _flat(text: str) -> str:
    """One line: an exception's own text may hold line breaks."""
    return " ".join(text.split())
