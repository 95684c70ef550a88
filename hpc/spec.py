"""JobSpec: what to run and on how much, one spec for PBS, SLURM and this machine.

A spec is a YAML file (usually under ``jobs/``) plus command-line overrides. It is
checked in two steps, both before anything is written: ``JobSpec.from_mapping``
checks keys and types (unknown keys are named with the nearest valid one), and
``hpc.job.resolve`` checks it against a cluster profile (queue limits, walltime, ppn
against devices, account) and fills in the defaults the profile gives.

Walltimes are ``HH:MM:SS`` only (hours may exceed 24, e.g. ``168:00:00``):
PBS and SLURM read a two-field ``A:B`` as minutes:seconds, which users rarely
mean, so it is refused rather than guessed. An unquoted ``1:00:00`` that YAML
turns into the number 3600 is taken as seconds, which is what it means.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc import schedulers
from hpc._util import (
    MAX_COUNT,
    directive_line,
    directive_value,
    load_yaml,
    parse_walltime,
    variable_name,
)
from hpc.errors import UserError
from hpc.schema import Key, Table, refuse

WRAP_MODES = ("auto", "always", "never")
_SIGNAL = r"^((R|B|RB|BR):)?(SIG)?[A-Z0-9]+(@\d+)?\Z"  # compiled on first use (re's cache)
#: A Python interpreter as the first word of a command (``python``, ``/venv/bin/python3.11``).
PYTHON = r"^(.*/)?python(\d+(\.\d+)*)?\Z"  # compiled on first use (re's cache)
_PATHLIKE = r"^[A-Za-z0-9_./~+-]+\Z"  # compiled on first use (re's cache)


@dataclass(frozen=True)
class JobSpec:
    """What the user asked for, type-checked but not yet fitted to a cluster.

    Frozen: a variant is ``dataclasses.replace(spec, ...)``, never a mutation.
    """

    name: str | None = None
    description: str = ""
    cluster: str | None = None
    nodes: int = 1
    ppn: int | None = None
    walltime: int | None = None  # seconds
    queue: str | None = None
    account: str | None = None
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    python: dict[str, str] | str | None = None
    output_dir: str = "logs"
    signal: str | None = None
    requeue: bool = False
    directives: list[str] = field(default_factory=list)
    launcher: str = "auto"
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    wrap: str = "auto"
    filesystems: str | None = None
    #: ``$NAME``/``${NAME}`` in command words expanded by the job's shell (opt-in: see
    #: :func:`hpc.launchers.var_word`); off, every word reaches the command byte-exact.
    expand_vars: bool = False
    #: stderr in its own log beside stdout's (SLURM ``NAME-ID.err``, PBS ``ID.ER``), as
    #: seed 001's scripts had (``tail -f logs/*.err``); off, one merged log.
    split_logs: bool = False
    #: each rank's output in RUN/ranks/rank-NNNNN.log (ddp.rank_logs; hpc logs --rank/--grep)
    per_rank_logs: bool = False
    #: the launch runs under ``python -m ddp.supervise`` with these settings (a hung or
    #: dead rank's node excluded, the rest relaunched in the same allocation); None: off
    resilience: dict[str, float | int] | None = None
    source: str | None = None  # the spec file, as the user named it

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str | None = None) -> JobSpec:
        """Check keys and types against :data:`SPEC`; the first mistake raises UserError."""
        SPEC.check_keys(data, f"spec {source}" if source else "spec")
        data = dict(data)
        if data.get("partition") is not None:
            part = data.pop("partition")
            if data.get("queue") is not None and data["queue"] != part:
                raise UserError(
                    f"partition: {part!r} conflicts with queue: {data['queue']!r}; "
                    "allowed: one of them (partition is an alias of queue)"
                )
            data["queue"] = part
        return cls(**SPEC.read(data), source=source)


def launcher_choices() -> tuple[str, ...]:
    """``auto`` (the profile's) and every kind of the launcher table, read at each check
    (:data:`hpc.schedulers.LAUNCHERS`: a kind added after import is a choice too)."""
    return ("auto", *schedulers.LAUNCHERS)


def load_spec(path: str | Path | None, overrides: dict[str, Any] | None = None) -> JobSpec:
    """Read a spec file and apply flag overrides (env merges per variable)."""
    data = load_yaml(Path(path), "spec") if path is not None else {}
    return JobSpec.from_mapping(merge_overrides(data, overrides or {}), str(path) if path else None)


def merge_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Flags win over the file; ``env`` is merged per variable, not replaced."""
    out = dict(data)
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "env" and isinstance(out.get("env"), dict):
            out["env"] = {**out["env"], **value}
        elif key == "queue":
            out.pop("partition", None)
            out["queue"] = value
        else:
            out[key] = value
    return out


# --- the keys' own readers (kind "custom" in SPEC) ----------------------------------


def _resilience(value: Any, label: str, got: dict[str, Any]) -> dict[str, float | int] | None:
    """``resilience: true`` (the defaults) or a mapping of :data:`RESILIENCE_KEYS`."""
    if value is False:
        return None
    if value is True:
        return dict(RESILIENCE)
    if not isinstance(value, dict):
        raise refuse(label, value, f"true, false or a mapping of {', '.join(RESILIENCE)}")
    RESILIENCE_KEYS.check_keys(value, label)
    return RESILIENCE_KEYS.read(value, label)


def _signal(value: str, label: str) -> str:
    if not re.match(_SIGNAL, value):
        raise UserError(
            f"{label}: {value!r} is not a signal spec; allowed: [B:]SIG[@SECONDS], e.g. USR1@90"
        )
    return value


def _lines(value: Any, label: str, got: dict[str, Any]) -> list[str]:
    """Setup is shell text by design (the user's own lines), one list item or line each."""
    if isinstance(value, str):
        lines = value.splitlines()
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        lines = list(value)
    else:
        raise refuse(label, value, "a list of shell lines")
    if any("\0" in line for line in lines):
        raise UserError(f"{label}: a line holds a NUL byte; allowed: shell text")
    return lines


def _command(value: Any, label: str, got: dict[str, Any]) -> list[str]:
    """Words as given, or split like a shell would (no expansion: the shell of the job's
    script expands nothing the user did not ask for, see ``expand_vars``)."""
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise UserError(
                f"{label}: {value!r} cannot be split into words ({exc}); "
                "allowed: a list of arguments or a shell-like string"
            ) from None
    if isinstance(value, list) and not any(isinstance(v, (dict, list)) or v is None for v in value):
        words = [str(v) for v in value]
        if any("\0" in w for w in words):
            raise UserError(f"{label}: an argument holds a NUL byte; allowed: text")
        return words
    raise refuse(label, value, "a list of arguments")


def _env(value: Any, label: str, got: dict[str, Any]) -> dict[str, str]:
    """Variables the job exports: a YAML true/false is 1/0, as a shell test expects."""
    if not isinstance(value, dict):
        raise refuse(label, value, "a mapping of NAME: value")
    out: dict[str, str] = {}
    for key, val in value.items():
        variable_name(key, label)
        if val is None or isinstance(val, (dict, list)):
            raise refuse(f"{label}.{key}", val, "a string or number")
        text = ("1" if val else "0") if isinstance(val, bool) else str(val)
        if "\0" in text:
            raise UserError(f"{label}.{key}: the value holds a NUL byte; allowed: text")
        out[str(key)] = text
    return out


def _python(value: Any, label: str, got: dict[str, Any]) -> dict[str, str] | str | None:
    """``python:`` of a spec: ``{venv: PATH}``, ``{conda: NAME}``, ``site`` or absent.

    ``site`` says: use the Python the profile's ``module load``/``setup`` lines give
    the job, record nothing at submit time (see :func:`submitting_python`). A venv may
    add ``stage: auto|always|never`` and ``pack: submit|job`` (``hpc.stage``: the venv
    copied to each node's local storage before the ranks start).
    """
    from hpc import stage as staging

    if value == "site":
        return "site"
    kinds = [k for k in value if k in ("venv", "conda")] if isinstance(value, dict) else []
    if len(kinds) != 1:
        raise refuse(label, value, "{venv: PATH}, {conda: NAME} or site")
    kind = kinds[0]
    extra = (
        sorted(set(value) - {kind, "stage", "pack"})
        if kind == "venv"
        else sorted(set(value) - {kind})
    )
    if extra:
        allowed = (
            "venv with stage and pack"
            if kind == "venv"
            else "conda alone (a conda "
            "environment cannot be moved by copying its folder, so it is never staged)"
        )
        raise UserError(f"{label}.{extra[0]}: not allowed here; allowed: {allowed}")
    where = value[kind]
    if not isinstance(where, str) or not where or "\0" in where:
        raise refuse(f"{label}.{kind}", where, "a non-empty string")
    # A quoted '~/venv' is not expanded by the shell: expand it here.
    out = {str(kind): os.path.expanduser(where) if kind == "venv" else where}
    if "stage" in value:
        out["stage"] = staging.check_spec_value(value["stage"])
    if "pack" in value:
        out["pack"] = staging.check_pack_value(value["pack"])
    return out


def _path(value: str, label: str) -> str:
    return path_value(value, label)


def _walltime(value: Any, label: str, got: dict[str, Any]) -> int:
    return parse_walltime(value, label)


# --- the job spec's keys, each declared once ---------------------------------------

_RUNS: dict[str, Any] = {"kind": "int", "high": 100_000, "nullable": False}
#: ``resilience:`` keys: ``python -m ddp.supervise``'s flags, bounds and defaults.
RESILIENCE_KEYS = Table(
    (
        Key(
            "hang_timeout_s",
            "number",
            600.0,
            "a rank silent this long is hung",
            low=1,
            high=7 * 86400,
            allowed="seconds from {low:g} to {high:g}",
            nullable=False,
        ),
        Key("max_restarts", default=3, help="relaunches before the job fails", low=0, **_RUNS),
        Key("min_nodes", default=1, help="fewest healthy nodes to relaunch on", low=1, **_RUNS),
        Key("spares", default=0, help="nodes held back to replace a lost one", low=0, **_RUNS),
    ),
    sep=".",
)
#: ``resilience:`` keys (python -m ddp.supervise's flags) and their defaults.
RESILIENCE: dict[str, float | int] = RESILIENCE_KEYS.defaults()
_DIRECTIVE = directive_value
_WHOLE: dict[str, Any] = {"kind": "int", "low": 1, "high": MAX_COUNT, "digits": True}
#: Every key of a job spec, in the order they are checked (:meth:`JobSpec.from_mapping`);
#: the defaults are :class:`JobSpec`'s own.
SPEC = Table(
    (
        Key("partition", "meta", help="SLURM's word for queue (an alias)"),
        Key("description", "text", help="free text for people"),
        Key("name", help="the job's name (default: from the command)"),
        Key("cluster", help="the profile to fit the job to (hpc clusters lists them)"),
        Key("nodes", help="nodes to run on", **_WHOLE),
        Key("ppn", help="ranks per node (default: the profile's)", **_WHOLE),
        Key("gpus_per_node", help="GPUs to ask for per node", **_WHOLE),
        Key("cpus_per_task", help="cores to ask for per rank", **_WHOLE),
        Key("walltime", "custom", help="HH:MM:SS (hours may exceed 24)", parse=_walltime),
        Key("queue", help="queue or partition (default: picked by size)", then=_DIRECTIVE),
        Key("account", help="the allocation charged", then=_DIRECTIVE),
        Key("filesystems", help="PBS -l filesystems= (default: the profile's)", then=_DIRECTIVE),
        Key("command", "custom", help="what each rank runs", parse=_command),
        Key("env", "custom", help="variables the job exports", parse=_env),
        Key("modules", "strings", help="modules to load", then=directive_line),
        Key("setup", "custom", help="shell lines run before the launch", parse=_lines),
        Key("python", "custom", help="{venv: PATH}, {conda: NAME} or site", parse=_python),
        Key("output_dir", help="where the logs go", then=_path),
        Key("signal", help="[B:]SIG[@SECONDS] sent before the walltime ends", then=_signal),
        Key("requeue", "bool", help="requeue after preemption or a node failure"),
        Key("expand_vars", "bool", help="the job's shell expands $NAME in the command"),
        Key("split_logs", "bool", help="stderr in its own log"),
        Key("per_rank_logs", "bool", help="each rank's output in its own log"),
        Key(
            "resilience",
            "custom",
            help="true or python -m ddp.supervise's settings",
            parse=_resilience,
        ),
        Key("directives", "strings", help="extra scheduler directive lines", then=directive_line),
        # read when checked: a new launcher (hpc.schedulers.LAUNCHERS) may join at run time
        Key("launcher", "choice", help="how ranks start", choices=lambda got: launcher_choices()),
        Key("wrap", "choice", help="ranks run under python -m ddp.exec", choices=WRAP_MODES),
    ),
    model=JobSpec,
)
SPEC_KEYS = SPEC.names()


def submitting_python(
    environ: Mapping[str, str],
    prefix: str | None = None,
    base_prefix: str | None = None,
) -> dict[str, str] | None:
    """The Python environment ``hpc submit`` runs from, for the job to activate.

    Why: ``sbatch`` exports the submitting shell's environment but ``qsub`` passes only
    ``PBS_O_*`` variables, so on PBS a job's ``python`` is the login shell's and
    ``python -m ddp.exec`` fails with ``No module named ddp``. Recording the
    environment at submit time makes a job run with the same Python on every
    scheduler. In order: an activated virtual environment (``$VIRTUAL_ENV``), the
    virtual environment of the interpreter running ``hpc`` (not activated, e.g.
    ``~/venv/bin/hpc``), an activated conda environment (``$CONDA_PREFIX``); None
    for a system Python (nothing to activate: the job's ``python`` is the login
    shell's, as before). The caller uses it only when the spec has no ``python:``.
    """
    prefix = sys.prefix if prefix is None else prefix
    base_prefix = sys.base_prefix if base_prefix is None else base_prefix
    venv = environ.get("VIRTUAL_ENV", "")
    if venv and os.path.isfile(os.path.join(venv, "bin", "activate")):
        return {"venv": venv}
    if prefix != base_prefix and os.path.isfile(os.path.join(prefix, "bin", "activate")):
        return {"venv": prefix}
    conda = environ.get("CONDA_PREFIX", "")
    if conda and os.path.isdir(os.path.join(conda, "conda-meta")):
        return {"conda": conda}
    return None


def conda_executable(env: str) -> str | None:
    """The conda that owns the environment at ``env``, for its shell hook; None if unknown.

    Why: a batch job's shell ran no ``conda init``, so it has no ``conda`` shell function
    and ``conda activate`` exits 1 ("Run 'conda init' before 'conda activate'"). The job
    first evaluates ``CONDA shell.bash hook`` of the conda the environment belongs to
    (not whichever is first on the job's PATH). Found, in order, as conda lays them out:
    the environment is an installation's base (``ENV/bin/conda``, as ``$CONDA_EXE``, or ``ENV/condabin/conda``);
    it is one of its named environments (``ROOT/envs/NAME``); it was made elsewhere
    (``conda create -p``) and the first ``# cmd:`` line of its ``conda-meta/history``
    names the conda (or mamba) that made it, in that program's folder.
    """
    from hpc._util import read_regular

    root = Path(env)
    if not (root / "conda-meta").is_dir():
        return None
    candidates = [root / "bin" / "conda", root / "condabin" / "conda"]
    if root.parent.name == "envs":
        candidates += [
            root.parent.parent / "bin" / "conda",
            root.parent.parent / "condabin" / "conda",
        ]
    try:
        history = read_regular(root / "conda-meta" / "history", "conda history", 1 << 24)
    except UserError:  # none, or not a plain file: no hint there
        history = b""
    for line in history.decode("utf-8", "replace").splitlines():
        if line.startswith("# cmd: "):
            program = Path((line[len("# cmd: ") :].split() or [""])[0])
            if program.is_absolute():
                candidates.append(program.parent / "conda")
            break
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def path_value(value: str, key: str) -> str:
    if not re.match(_PATHLIKE, value):
        raise refuse(key, value, "a path of letters, digits and _ . / ~ + -")
    # Neither sbatch nor qsub expands ~ in #SBATCH/#PBS paths: expand it here.
    return os.path.expanduser(value)
