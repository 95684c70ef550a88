"""JobSpec: what to run and on how much, one spec for PBS, SLURM and this machine.

A spec is a YAML file (usually under ``jobs/``) plus command-line overrides. It is
checked in two steps, both before anything is written: ``JobSpec.from_mapping``
checks keys and types (unknown keys are named with the nearest valid one), and
``resolve`` checks it against a cluster profile (queue limits, walltime, ppn
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
from pathlib import Path
from typing import Any

from hpc._util import (
    REQUIRED,
    Record,
    check_keys,
    did_you_mean,
    directive_value,
    format_walltime,
    job_name,
    load_yaml,
    parse_walltime,
)
from hpc.cluster import Cluster, Queue
from hpc.errors import UserError

SPEC_KEYS = (
    "name", "description", "cluster", "nodes", "ppn", "walltime", "queue", "partition",
    "account", "command", "env", "modules", "setup", "python", "output_dir", "signal",
    "requeue", "directives", "launcher", "gpus_per_node", "cpus_per_task", "wrap",
    "filesystems",
)
WRAP_MODES = ("auto", "always", "never")
LAUNCHERS = ("auto", "mpiexec", "srun", "torchrun")
LAUNCHERS_BY_SCHEDULER = {"pbs": ("mpiexec",), "slurm": ("srun", "torchrun"), "local": ("torchrun",)}
DEFAULT_WALLTIME = 3600
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*\Z"  # compiled on first use (re's cache)
_SIGNAL = r"^((R|B|RB|BR):)?(SIG)?[A-Z0-9]+(@\d+)?\Z"  # compiled on first use (re's cache)
_PYTHON = r"^(.*/)?python(\d+(\.\d+)*)?\Z"  # compiled on first use (re's cache)
_PATHLIKE = r"^[A-Za-z0-9_./~+-]+\Z"  # compiled on first use (re's cache)


class JobSpec(Record):
    """What the user asked for, type-checked but not yet fitted to a cluster."""

    name: str | None
    description: str
    cluster: str | None
    nodes: int
    ppn: int | None
    walltime: int | None  # seconds
    queue: str | None
    account: str | None
    command: list[str]
    env: dict[str, str]
    modules: list[str]
    setup: list[str]
    python: dict[str, str] | str | None
    output_dir: str
    signal: str | None
    requeue: bool
    directives: list[str]
    launcher: str
    gpus_per_node: int | None
    cpus_per_task: int | None
    wrap: str
    filesystems: str | None
    source: str | None  # the spec file, as the user named it
    _defaults = {
        "name": None, "description": "", "cluster": None, "nodes": 1, "ppn": None,
        "walltime": None, "queue": None, "account": None, "command": [], "env": {},
        "modules": [], "setup": [], "python": None, "output_dir": "logs", "signal": None,
        "requeue": False, "directives": [], "launcher": "auto", "gpus_per_node": None,
        "cpus_per_task": None, "wrap": "auto", "filesystems": None, "source": None,
    }

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str | None = None) -> JobSpec:
        """Check keys and types; the first mistake raises UserError naming it."""
        where = f"spec {source}" if source else "spec"
        check_keys(data, SPEC_KEYS, where)
        data = dict(data)
        if data.get("partition") is not None:
            part = data.pop("partition")
            if data.get("queue") is not None and data["queue"] != part:
                raise UserError(
                    f"partition: {part!r} conflicts with queue: {data['queue']!r}; "
                    "allowed: one of them (partition is an alias of queue)"
                )
            data["queue"] = part
        data.pop("partition", None)
        spec = cls(source=source)
        if data.get("name") is not None:
            spec.name = _str(data, "name")
        spec.description = str(data.get("description") or "")
        if data.get("cluster") is not None:
            spec.cluster = _str(data, "cluster")
        if data.get("nodes") is not None:
            spec.nodes = _int(data, "nodes")
        spec.ppn = _int(data, "ppn") if data.get("ppn") is not None else None
        if data.get("walltime") is not None:
            spec.walltime = parse_walltime(data["walltime"])
        if data.get("queue") is not None:
            spec.queue = directive_value(_str(data, "queue"), "queue")
        if data.get("account") is not None:
            spec.account = directive_value(_str(data, "account"), "account")
        spec.command = _command(data.get("command"))
        spec.env = _env(data.get("env"))
        spec.modules = _strings(data, "modules")
        spec.setup = _lines(data.get("setup"))
        spec.python = _python(data.get("python"))
        if data.get("output_dir") is not None:
            spec.output_dir = _path(_str(data, "output_dir"), "output_dir")
        if data.get("signal") is not None:
            sig = _str(data, "signal")
            if not re.match(_SIGNAL, sig):
                raise UserError(
                    f"signal: {sig!r} is not a signal spec; allowed: [B:]SIG[@SECONDS], e.g. USR1@90"
                )
            spec.signal = sig
        spec.requeue = _bool(data, "requeue")
        spec.directives = _strings(data, "directives")
        for d in spec.directives:
            if any(c in d for c in "\n\r\0"):
                raise UserError(f"directives: {d!r} spans lines; allowed: one directive per item")
        spec.launcher = _choice(data, "launcher", LAUNCHERS, "auto")
        for key in ("gpus_per_node", "cpus_per_task"):
            if data.get(key) is not None:
                setattr(spec, key, _int(data, key))
        spec.wrap = _choice(data, "wrap", WRAP_MODES, "auto")
        if data.get("filesystems") is not None:
            spec.filesystems = directive_value(_str(data, "filesystems"), "filesystems")
        return spec


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> JobSpec:
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


# --- field checks -------------------------------------------------------------------


def _str(data: dict[str, Any], key: str) -> str:
    value = data[key]
    if isinstance(value, (dict, list, bool)):
        raise UserError(f"{key}: {value!r} is not allowed; allowed: a string")
    return str(value)


def _int(data: dict[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{key}: {value!r} is not allowed; allowed: a whole number >= 1")
    return value


def _bool(data: dict[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise UserError(f"{key}: {value!r} is not allowed; allowed: true or false")
    return value


def _choice(data: dict[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = data.get(key)
    if value is None:
        return default
    if value not in allowed:
        raise UserError(
            f"{key}: {value!r} is not allowed{did_you_mean(str(value), allowed)}; "
            f"allowed: {', '.join(allowed)}"
        )
    return str(value)


def _strings(data: dict[str, Any], key: str) -> list[str]:
    value = data.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or any(isinstance(v, (dict, list)) for v in value):
        raise UserError(f"{key}: {value!r} is not allowed; allowed: a list of strings")
    return [str(v) for v in value]


def _lines(value: Any) -> list[str]:
    """Setup is shell text by design (the user's own lines), one list item or line each."""
    if value is None:
        return []
    if isinstance(value, str):
        lines = value.splitlines()
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        lines = list(value)
    else:
        raise UserError(f"setup: {value!r} is not allowed; allowed: a list of shell lines")
    if any("\0" in line for line in lines):
        raise UserError("setup: a line holds a NUL byte; allowed: shell text")
    return lines


def _command(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise UserError(f"command: {value!r} cannot be split into words ({exc}); "
                            "allowed: a list of arguments or a shell-like string") from None
    if isinstance(value, list) and not any(isinstance(v, (dict, list)) or v is None for v in value):
        words = [str(v) for v in value]
        if any("\0" in w for w in words):
            raise UserError("command: an argument holds a NUL byte; allowed: text")
        return words
    raise UserError(f"command: {value!r} is not allowed; allowed: a list of arguments")


def _env(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"env: {value!r} is not allowed; allowed: a mapping of NAME: value")
    out: dict[str, str] = {}
    for key, val in value.items():
        if not re.match(_ENV_NAME, str(key)):
            raise UserError(
                f"env: {str(key)!r} is not a variable name; allowed: letters, digits and _, "
                "not starting with a digit"
            )
        if val is None or isinstance(val, (dict, list)):
            raise UserError(f"env.{key}: {val!r} is not allowed; allowed: a string or number")
        text = ("1" if val else "0") if isinstance(val, bool) else str(val)
        if "\0" in text:
            raise UserError(f"env.{key}: the value holds a NUL byte; allowed: text")
        out[str(key)] = text
    return out


def _python(value: Any) -> dict[str, str] | str | None:
    """``python:`` of a spec: ``{venv: PATH}``, ``{conda: NAME}``, ``site`` or absent.

    ``site`` says: use the Python the profile's ``module load``/``setup`` lines give
    the job, record nothing at submit time (see :func:`submitting_python`).
    """
    if value is None:
        return None
    if value == "site":
        return "site"
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in ("venv", "conda"):
        raise UserError(
            f"python: {value!r} is not allowed; allowed: {{venv: PATH}}, {{conda: NAME}} or site"
        )
    kind, where = next(iter(value.items()))
    if not isinstance(where, str) or not where or "\0" in where:
        raise UserError(f"python.{kind}: {where!r} is not allowed; allowed: a non-empty string")
    # A quoted '~/venv' is not expanded by the shell: expand it here.
    return {str(kind): os.path.expanduser(where) if kind == "venv" else where}


def submitting_python(
    environ: Mapping[str, str], prefix: str | None = None, base_prefix: str | None = None,
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


def _path(value: str, key: str) -> str:
    if not re.match(_PATHLIKE, value):
        raise UserError(
            f"{key}: {value!r} is not allowed; allowed: a path of letters, digits and _ . / ~ + -"
        )
    # Neither sbatch nor qsub expands ~ in #SBATCH/#PBS paths: expand it here.
    return os.path.expanduser(value)


# --- resolution against a cluster ---------------------------------------------------


class Job(Record):
    """A spec fitted to a cluster: every value final, ready to render."""

    spec: JobSpec
    cluster: Cluster
    name: str
    nodes: int
    ppn: int
    walltime: int
    queue: str | None
    account: str | None
    account_deferred: bool
    gpus_per_node: int | None
    cpus_per_task: int | None
    launcher: str
    wrapped: bool
    filesystems: str | None
    _defaults = {k: REQUIRED for k in (
        "spec", "cluster", "name", "nodes", "ppn", "walltime", "queue", "account",
        "account_deferred", "gpus_per_node", "cpus_per_task", "launcher", "wrapped", "filesystems",
    )}

    @property
    def ranks(self) -> int:
        """Total number of processes."""
        return self.nodes * self.ppn

    def to_dict(self) -> dict[str, Any]:
        """The resolved spec as written to a run directory (loadable as a spec again)."""
        s = self.spec
        out: dict[str, Any] = {
            "name": self.name, "cluster": self.cluster.name, "nodes": self.nodes,
            "ppn": self.ppn, "walltime": format_walltime(self.walltime), "queue": self.queue,
            "account": self.account, "command": list(s.command), "env": dict(s.env),
            "modules": list(s.modules), "setup": list(s.setup), "python": s.python,
            "output_dir": s.output_dir, "signal": s.signal, "requeue": s.requeue,
            "directives": list(s.directives), "launcher": self.launcher,
            "gpus_per_node": self.gpus_per_node, "cpus_per_task": self.cpus_per_task,
            "wrap": "always" if self.wrapped else "never", "filesystems": self.filesystems,
        }
        if s.description:
            out["description"] = s.description
        return {k: v for k, v in out.items() if v not in (None, [], {})}


def is_ddp_command(command: list[str]) -> bool:
    """True for this project's entry points, which read any launcher's variables themselves."""
    if not command:
        return False
    if Path(command[0]).name in ("ddp-exec",):
        return True
    return (
        bool(re.match(_PYTHON, command[0]))
        and len(command) >= 3
        and command[1] == "-m"
        and command[2] in ("ddp", "ddp.exec")
    )


def default_name(command: list[str]) -> str:
    """A name from the command: the recipe, the script stem, or the program."""
    if is_ddp_command(command) and len(command) > 3:
        return command[3]
    for word in command[1:] if command and re.match(_PYTHON, command[0]) else command:
        if word.endswith(".py"):
            return Path(word).stem
    if command and re.match(_PYTHON, command[0]) and "-m" in command[:-1]:
        return command[command.index("-m") + 1].split(".")[-1]
    return Path(command[0]).name if command else "job"


def _pick_queue(spec: JobSpec, cluster: Cluster, nodes: int) -> tuple[str | None, int]:
    """Check or choose the queue; return it with the walltime (seconds) to ask for."""
    queues = cluster.queues
    if spec.queue is not None:
        if not queues:  # no site facts: any name goes, nothing to check
            return spec.queue, spec.walltime or DEFAULT_WALLTIME
        q = queues.get(spec.queue)
        if q is None:
            raise UserError(
                f"queue: {spec.queue!r} is not a queue of {cluster.name}"
                f"{did_you_mean(spec.queue, queues)}; allowed: {', '.join(queues)}"
            )
        if not q.min_nodes <= nodes <= q.max_nodes:
            raise UserError(
                f"nodes: {nodes} does not fit queue {q.name} of {cluster.name}; "
                f"allowed: {q.min_nodes}-{q.max_nodes}{_fits(cluster.auto_queues(), nodes, None)}"
            )
        limit = q.walltime_limit(nodes)
        walltime = spec.walltime or min(DEFAULT_WALLTIME, limit or DEFAULT_WALLTIME)
        if limit is not None and walltime > limit:
            raise UserError(
                f"walltime: {format_walltime(walltime)} exceeds queue {q.name} of {cluster.name} "
                f"for {nodes} nodes; allowed: up to {format_walltime(limit)}"
                f"{_fits(cluster.auto_queues(), nodes, walltime)}"
            )
        return q.name, walltime
    if not queues:
        return None, spec.walltime or DEFAULT_WALLTIME
    walltime = spec.walltime or DEFAULT_WALLTIME
    for q in cluster.auto_queues():
        limit = q.walltime_limit(nodes)
        if q.min_nodes <= nodes <= q.max_nodes and (limit is None or walltime <= limit):
            return q.name, walltime
    raise UserError(
        f"nodes/walltime: no queue of {cluster.name} takes {nodes} nodes for "
        f"{format_walltime(walltime)}; allowed: "
        + "; ".join(q.describe() for q in queues.values())
    )


def _fits(queues: Any, nodes: int, walltime: int | None) -> str:
    """' (queue X fits)' to point at a queue that would take the job."""
    for q in queues:
        limit = q.walltime_limit(nodes)
        if q.min_nodes <= nodes <= q.max_nodes and (
            walltime is None or limit is None or walltime <= limit
        ):
            return f" (queue {q.name} takes it)"
    return ""


def resolve(
    spec: JobSpec,
    cluster: Cluster,
    environ: dict[str, str] | None = None,
    defer_account: bool = False,
) -> Job:
    """Fit ``spec`` to ``cluster``; every check happens here, before anything is written.

    ``environ`` supplies the account variables (``PBS_ACCOUNT``, ``SBATCH_ACCOUNT``,
    ``HPC_ACCOUNT`` as the profile lists); pass ``{}`` for renders that must not
    depend on the caller's environment. ``defer_account`` allows a missing account
    on a site that requires one: the directive is left out, to be given at submit
    time (``qsub -A PROJECT script``).
    """
    environ = {} if environ is None else environ
    if not spec.command:
        raise UserError(
            "command: missing; allowed: a list in the spec (command: [python, train.py]) "
            "or the words after -- on the command line"
        )
    nodes = spec.nodes
    if cluster.max_nodes is not None and nodes > cluster.max_nodes:
        raise UserError(
            f"nodes: {nodes} exceeds what {cluster.name} offers; allowed: 1-{cluster.max_nodes}"
        )
    ppn = spec.ppn or cluster.ppn
    if cluster.devices_per_node is not None and ppn > cluster.devices_per_node:
        raise UserError(
            f"ppn: {ppn} exceeds the {cluster.devices_per_node} {cluster.device} devices per node "
            f"of {cluster.name}; allowed: 1-{cluster.devices_per_node}"
        )
    queue, walltime = _pick_queue(spec, cluster, nodes)

    account = spec.account
    if account is None:
        for var in cluster.account_env:
            if environ.get(var):
                account = directive_value(environ[var], f"account (from ${var})")
                break
    deferred = False
    if account is None and cluster.account_required:
        if not defer_account:
            envs = "/".join(cluster.account_env) or "HPC_ACCOUNT"
            raise UserError(
                f"account: missing; {cluster.name} requires a project allocation; allowed: "
                f"--account PROJECT, account: in the spec, or ${envs}"
            )
        deferred = True

    gpus = spec.gpus_per_node
    if gpus is not None:
        if cluster.gpu_directive == "none":
            raise UserError(
                f"gpus_per_node: {gpus} cannot be asked for on {cluster.name}, which allocates "
                "whole nodes; allowed: leave it out"
            )
        if cluster.devices_per_node is not None and gpus > cluster.devices_per_node:
            raise UserError(
                f"gpus_per_node: {gpus} exceeds the {cluster.devices_per_node} devices per node "
                f"of {cluster.name}; allowed: 1-{cluster.devices_per_node}"
            )
    elif cluster.gpu_directive != "none":
        gpus = cluster.gpus_per_node

    launcher = cluster.launcher.kind if spec.launcher == "auto" else spec.launcher
    allowed = LAUNCHERS_BY_SCHEDULER[cluster.scheduler]
    if launcher not in allowed:
        raise UserError(
            f"launcher: {launcher!r} is not available on {cluster.name} ({cluster.scheduler}); "
            f"allowed: auto, {', '.join(allowed)}"
        )
    cluster.check_job(queue, walltime, launcher, allowed)
    if spec.wrap == "always":
        wrapped = True
    elif spec.wrap == "never":
        wrapped = False
    else:  # torchrun already exports RANK/LOCAL_RANK/...; mpiexec and srun do not
        wrapped = launcher in ("mpiexec", "srun") and not is_ddp_command(spec.command)

    if spec.filesystems is not None and cluster.scheduler != "pbs":
        raise UserError(
            f"filesystems: {spec.filesystems!r} is a PBS resource; {cluster.name} is "
            f"{cluster.scheduler}; allowed: leave it out"
        )
    return Job(
        spec=spec,
        cluster=cluster,
        name=job_name(spec.name or default_name(spec.command)),
        nodes=nodes,
        ppn=ppn,
        walltime=walltime,
        queue=queue,
        account=account,
        account_deferred=deferred,
        gpus_per_node=gpus,
        cpus_per_task=spec.cpus_per_task or cluster.cpus_per_task,
        launcher=launcher,
        wrapped=wrapped,
        filesystems=spec.filesystems or cluster.filesystems,
    )


def queue_of(cluster: Cluster, name: str | None) -> Queue | None:
    """The Queue object named ``name`` (None for free-form queues)."""
    return cluster.queues.get(name) if name else None
