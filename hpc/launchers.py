"""Launch lines: mpiexec (PALS or hydra), srun, torchrun per node, and this machine.

Each scheduler's ``launch`` picks one of these builders. The builders return words;
:func:`sh_join` quotes every word that comes from the user (``shlex.quote``); only
the ``Raw`` fragments written in this module (``"$SLURM_JOB_ID"`` and the like)
go into the script as they are.

A spec with ``expand_vars: true`` lets its command words name site variables
(``$SCRATCH/x``, ``${PBS_O_WORKDIR}``): :func:`var_word` writes each such word as
single-quoted literal pieces joined to ``"${NAME:?}"`` pieces, so the job's shell
expands the variable and nothing else (no command substitution, backticks, globs or
word splitting, in the word or in the variable's value). Opt-in, because a word that is
itself shell code (``bash -c 'echo $x'``) would otherwise see its ``$x`` replaced by the
outer shell, a value turned into code. ``:?``: an unset or empty variable ends the job
naming it, rather than running with ``/x`` for ``$SCRATCH/x``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from hpc._util import NAME
from hpc.errors import UserError
from hpc_ddp.ports import DEFAULT_PORT

if TYPE_CHECKING:
    from hpc.job import Job

_BARE_PYTHON = r"^python(3(\.\d+)?)?\Z"  # compiled on first use (re's cache)


class Raw(str):
    """Shell text written by this module, never by the user: not quoted."""


#: ``$NAME`` or ``${NAME}``, NAME a shell identifier: the only expansion a word may ask for.
VAR = rf"\$(?:({NAME})|\{{({NAME})\}})"


def var_pieces(word: str) -> list[tuple[str, bool]]:
    """``word`` as (text, is_variable_name) pieces, in order; empty literal pieces left out."""
    pieces: list[tuple[str, bool]] = []
    at = 0
    for m in re.finditer(VAR, word):
        if m.start() > at:
            pieces.append((word[at : m.start()], False))
        pieces.append((m.group(1) or m.group(2), True))
        at = m.end()
    if at < len(word):
        pieces.append((word[at:], False))
    return pieces


def var_word(word: str) -> str:
    """One shell word in which only ``$NAME``/``${NAME}`` is expanded (see the module doc).

    Literal pieces go through ``shlex.quote`` (single quotes: nothing inside is special),
    each variable as ``"${NAME:?}"`` (double quotes: its value is not split, globbed or
    expanded again); adjacent quoted pieces make one word. A word without a variable is
    exactly ``shlex.quote(word)``.
    """
    pieces = var_pieces(word)
    if not any(is_var for _, is_var in pieces):
        return shlex.quote(word)
    return "".join(f'"${{{text}:?}}"' if is_var else shlex.quote(text) for text, is_var in pieces)


def expand_here(word: str, environ: Mapping[str, str]) -> tuple[str, list[str]]:
    """(``word`` as the job will see it where ``environ`` is the job's, names not set
    there): an unknown variable is left as ``$NAME`` for ``--dry-run`` to show."""
    missing: list[str] = []
    out: list[str] = []
    for text, is_var in var_pieces(word):
        if is_var and environ.get(text):
            out.append(environ[text])
        elif is_var:
            missing.append(text)
            out.append(f"${{{text}}}")
        else:
            out.append(text)
    return "".join(out), missing


def sh_join(words: Iterable[str]) -> str:
    """Join words into one shell line, quoting all but ``Raw`` ones."""
    return " ".join(w if isinstance(w, Raw) else shlex.quote(str(w)) for w in words)


def python_of(command: list[str]) -> str:
    """The interpreter to run ``ddp.exec`` with: the command's own, else ``python``."""
    from hpc.spec import PYTHON  # here: hpc.spec imports hpc.schedulers, whose table imports us

    return command[0] if command and re.match(PYTHON, command[0]) else "python"


def supervised(job: Job, launch: list[Any]) -> list[Any]:
    """``python -m ddp.supervise FLAGS -- LAUNCH`` for a spec with ``resilience:``: the
    supervisor inside the allocation relaunches without a hung or dead rank's node.

    It reads the launch line it relaunches, so it must be a launcher the scheduler lists
    in ``supervised_launchers``: ``srun`` on SLURM (rendered with ``--no-kill``),
    ``mpiexec`` on PBS (``tolerate_node_failures``, a rewritten host file per relaunch),
    the local ``torchrun``; one torchrun per node is not done."""
    r = job.spec.resilience or {}
    sched = job.scheduler
    if not sched.supervises(job):
        raise UserError(
            f"resilience: not available for {sched.name} with launcher "
            f"{job.launcher}; allowed: {sched.name} with "
            f"{' or '.join(sched.supervised_launchers) or 'no launcher'}"
        )
    if int(r["min_nodes"]) > job.nodes:
        raise UserError(
            f"resilience.min_nodes: {r['min_nodes']} is more than the job's "
            f"{job.nodes} node(s); allowed: 1 to {job.nodes}"
        )
    flags = [
        f"--hang-timeout-s={float(r['hang_timeout_s']):g}",
        f"--max-restarts={int(r['max_restarts'])}",
        f"--min-nodes={int(r['min_nodes'])}",
        f"--spares={int(r['spares'])}",
    ]
    if job.stage is not None and job.stage.tolerant:  # nodes that failed to unpack: left out
        flags.append(Raw('--staged="$HPC_STAGE_OK"'))
    concurrent = job.cluster.launcher.concurrent_args
    if concurrent:  # one word: the supervisor splits it (ddp.supervise --concurrent-args)
        flags.append(f"--concurrent-args={sh_join(concurrent)}")
    return [python_of(job.spec.command), "-m", "ddp.supervise", *flags, "--", *launch]


def wrapped(job: Job) -> list[str]:
    """The command, behind ``python -m ddp.exec --`` when the job asks for it.

    ``ddp.exec`` exports torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, ...) from whatever launcher started the process, so a plain
    torchrun-style script runs unchanged under mpiexec or srun.
    """
    cmd = list(job.spec.command)
    if job.spec.expand_vars:  # Raw: written as var_word made it, not quoted again
        cmd = [Raw(var_word(w)) if re.search(VAR, w) else w for w in cmd]
    if job.wrapped:
        return [python_of(cmd), "-m", "ddp.exec", "--", *cmd]
    return cmd


def torchrun_args(command: list[str]) -> list[str]:
    """What follows torchrun's own options: ``train.py ARGS``, ``-m mod ARGS`` or ``--no-python CMD``."""
    if len(command) >= 2 and re.match(_BARE_PYTHON, command[0]):
        rest = command[1:]
        if rest[0] == "-m" and len(rest) >= 2:
            return ["-m", *rest[1:]]
        if not rest[0].startswith("-"):
            return rest
    return ["--no-python", *command]


def labelled(job: Job) -> bool:
    """True when the merged job log is rank-labelled by the launcher: whenever each
    rank's own file is off (``per_rank_logs``). A 1,000-rank job's merged log is
    otherwise a mix nobody can attribute; ``hpc logs --rank/--grep`` read the labels
    (:mod:`hpc.logs`)."""
    return not job.spec.per_rank_logs


def mpiexec(job: Job) -> list[str]:
    """``mpiexec -n RANKS --ppn PPN [--depth D] [--cpu-bind B]`` (PALS) or hydra's ``-ppn``.

    Labels (:func:`labelled`): PALS ``--label --line-buffer``: each line prefixed with
    its rank, and whole lines, so two ranks' output never shares one (HPE's PALS
    mpiexec(1) is behind HPE's support portal: the ``RANK: `` format is unverified,
    taken from users' Cray PALS logs; tests/support/pals/mpiexec mimics it). MPICH
    hydra: ``-prepend-rank`` ("prepend rank to output" in ``mpiexec.hydra -help``,
    MPICH 4.0.2 as run here), which prints ``[RANK] ``."""
    launcher = job.cluster.launcher
    words: list[str] = ["mpiexec", "-n", str(job.ranks)]
    if launcher.flavor == "pals":
        words += ["--ppn", str(job.ppn)]
        if launcher.depth:
            words += ["--depth", str(launcher.depth)]
        cpu_bind = job.cluster.layout(job.ppn).cpu_bind  # per ppn (hpc.cluster.Tiles)
        if cpu_bind:
            words += ["--cpu-bind", cpu_bind]
        label = ["--label", "--line-buffer"] if labelled(job) else []
    else:
        words += ["-ppn", str(job.ppn)]
        label = ["-prepend-rank"] if labelled(job) else []
    return [*words, *launcher.args, *label, *wrapped(job)]  # labels last: site flags stay put


def srun(job: Job) -> list[str]:
    """``srun --kill-on-bad-exit=1``; tasks come from the allocation.

    Since SLURM 22.05 srun no longer inherits ``--cpus-per-task`` from sbatch, so
    it is repeated here. ``--label`` (``RANK: `` before each line,
    https://slurm.schedmd.com/srun.html#OPT_label) unless each rank has its own file
    (:func:`labelled`).
    """
    words = ["srun", "--kill-on-bad-exit=1"]
    if job.cpus_per_task:
        words.append(f"--cpus-per-task={job.cpus_per_task}")
    label = ["--label"] if labelled(job) else []
    return [*words, *job.cluster.launcher.args, *label, *wrapped(job)]  # labels last


def torchrun_per_node(job: Job) -> tuple[list[str], list[str]]:
    """One torchrun per node through srun, c10d rendezvous on the first node.

    The first node's address is taken from ``scontrol show node`` (NodeAddr), which
    also works where node names do not resolve; ``DDP_MASTER_ADDR_SUFFIX`` from the
    profile is appended (e.g. a high-speed network domain).
    """
    preamble = [
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'head_addr=$(scontrol show node "$head_node" 2>/dev/null'
        " | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)",
        'head_addr="${head_addr:-$head_node}${DDP_MASTER_ADDR_SUFFIX:-}"',
    ]
    words = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", f"--nodes={job.nodes}"]
    if job.cpus_per_task:
        words.append(f"--cpus-per-task={job.cpus_per_task * job.ppn}")
    # Per-task GPU binding (--gpus-per-task, --gpu-bind) would give the one torchrun task
    # a single GPU for all of its ranks; torchrun's children pick theirs by local rank.
    site_args = [
        a for a in job.cluster.launcher.args if not a.startswith(("--gpus-per-task", "--gpu-bind"))
    ]
    words += [
        *site_args,
        "torchrun",
        "--nnodes",
        str(job.nodes),
        "--nproc_per_node",
        str(job.ppn),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        Raw(f'"${{head_addr}}:${{MASTER_PORT:-{DEFAULT_PORT}}}"'),  # hpc_ddp.ports' default
        "--rdzv_id",
        Raw('"$SLURM_JOB_ID"'),
        *torchrun_args(wrapped(job)),
    ]
    return preamble, words


def local(job: Job) -> list[str]:
    """This machine: the command itself for one rank, else ``torchrun --standalone``."""
    if job.ranks == 1:
        return wrapped(job)
    return [
        "torchrun",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(job.ppn),
        *torchrun_args(wrapped(job)),
    ]
