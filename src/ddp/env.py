"""Who am I? Launcher detection for the compute node.

Every launcher tells a process its rank in its own variables. ``detect()`` reads
them in a fixed priority order and returns one :class:`DistEnv`:

1. ``DDP_LAUNCHER`` forces a detector by name (``single`` included); no guard below
   second-guesses a forced choice.
2. ``torchrun``: RANK / WORLD_SIZE / LOCAL_RANK (torchrun, ``torch.distributed.launch
   --use-env``, or a wrapper that exports them). Checked first, so torchrun started
   inside a SLURM or PBS job wins. Real torchrun always adds TORCHELASTIC_RUN_ID;
   without it the values are trusted only while they agree with the scheduler's own
   launcher (see *stale variables* below).
3. ``legacy``: ``torch.distributed.launch`` without ``--use-env`` passes
   ``--local_rank=N`` / ``--local-rank=N`` on the command line, RANK/WORLD_SIZE in env.
4. ``pals``: Aurora/Polaris PALS ``mpiexec`` (PALS_RANKID, PALS_LOCAL_RANKID,
   PALS_LOCAL_SIZE, PALS_NODEID, PMI_RANK, PMI_SIZE, PMI_LOCAL_RANK, PMI_LOCAL_SIZE).
   Under ``--pmi=pmix`` PMI_SIZE may be absent: the world is then the node count of
   PBS_NODEFILE times the ranks per node (``--ppn``), and the log says so.
5. ``lsf``: IBM LSF ``jsrun`` (JSM_NAMESPACE_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; hosts
   from LSB_DJOB_RANKFILE, whose first line is the launch node; port from LSB_JOBID).
   Before ``openmpi`` because Spectrum MPI under jsrun also sets OMPI_* variables.
6. ``openmpi``: OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}.
7. ``mvapich``: MVAPICH's ``mpirun_rsh`` (MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}).
8. ``mpich``: MPICH hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS).
9. ``slurm``: a task started by ``srun`` (SLURM_PROCID, SLURM_STEP_NUM_TASKS,
   SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_ID). A SLURM *batch shell* running python
   without srun while SLURM_NTASKS > 1 is refused: it would wait forever for ranks
   that never start.
10. ``single``: no launcher; world size 1.

Never training alone by mistake:

- *Stale variables*: RANK/WORLD_SIZE without TORCHELASTIC_RUN_ID (left in a shell,
  exported by an outer wrapper) that contradict what srun, PALS or an MPI launcher
  says about this very process stop every rank with one line naming both values.
- *Unknown launchers*: when detection answers world size 1 while any launcher's
  size variable (PMI_SIZE, OMPI_COMM_WORLD_SIZE, ...) says more than one process,
  the rank stops instead of training alone and writing the same checkpoints as
  its peers.

Rank layout: local rank and ranks per node come from the launcher's own per-node
variables. Where a launcher gives none, they are derived from the job's host list
(PBS_NODEFILE, the LSF rank file, the SLURM node list) only when every fact agrees
with block placement, the default of mpiexec/PALS (``--ppn``) and jsrun; otherwise
``local_world_size`` (and ``node_rank`` if nothing names it) is ``None``: not
known, said once in the log, never guessed differently on different nodes.

Master address: MASTER_ADDR if set, else the first host of PBS_NODEFILE, the LSF
rank file or the SLURM node list, else ``localhost``. When derived from a host list,
``DDP_MASTER_ADDR_SUFFIX`` replaces the host's domain (Aurora's high-speed network
names, e.g. ``.hsn.cm.aurora.alcf.anl.gov``).

Master port: MASTER_PORT if set, else derived from the job id (SLURM_JOB_ID,
PBS_JOBID, Open MPI's job id, LSB_JOBID) as ``20000 + id % 9000``, so every rank
computes the same port in 20000-28999 (below Linux's ephemeral range), and two
jobs sharing a node rarely collide. A single-node MPI run with no job id uses its
launcher proxy's pid (the common parent of all its ranks) the same way; otherwise
29500.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence

from ddp.env_layout import (  # noqa: F401  (re-exported: ddp.env.X is what callers name)
    DEFAULT_PORT,
    PORT_BASE,
    PORT_SPAN,
    DistEnv,
    _build,
    _int,
    _legacy_local_rank,
    job_id,
)
from ddp.errors import ConfigError
from ddp.hostlist import expand_nodelist, job_hosts, parse_tasks_per_node, unique

__all__ = ["DETECTORS", "DistEnv", "detect", "expand_nodelist"]


# --------------------------------------------------------------------------- detectors
# Each returns a DistEnv when its launcher is present, None otherwise.


def _torchrun(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "RANK" not in env or "LOCAL_RANK" not in env:
        return None
    return _build(
        env,
        "torchrun",
        _int(env, "RANK"),
        _int(env, "WORLD_SIZE"),
        _int(env, "LOCAL_RANK"),
        _int(env, "LOCAL_WORLD_SIZE"),
        _int(env, "GROUP_RANK", "NODE_RANK"),
        "RANK",
        "WORLD_SIZE",
    )


def _legacy(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "RANK" not in env:
        return None
    try:
        local = _legacy_local_rank(argv)
    except ValueError:
        raise ConfigError("--local_rank: expected an integer") from None
    if local is None:
        return None
    return _build(
        env,
        "legacy",
        _int(env, "RANK"),
        _int(env, "WORLD_SIZE"),
        local,
        _int(env, "LOCAL_WORLD_SIZE"),
        _int(env, "GROUP_RANK", "NODE_RANK"),
        "RANK",
        "WORLD_SIZE",
    )


def _in_srun_step(env: Mapping[str, str], rank_var: str) -> bool:
    """True inside an srun task whose SLURM rank equals the MPI-style rank ``rank_var``.

    srun's MPI plugins export PMI-style variables too (pmi2: PMI_RANK/PMI_SIZE;
    cray_shasta: PALS_RANKID/PALS_NODEID) but not the local rank or size; the SLURM
    variables describe the same task completely, so the slurm detector should answer.
    An mpirun inside a SLURM job has its own ranks and keeps its own detector.
    """
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return (
        step is not None
        and step not in _SLURM_NON_TASK_STEPS
        and env.get("SLURM_PROCID") is not None
        and env.get("SLURM_PROCID") == env.get(rank_var)
    )


def _pals(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "PALS_RANKID" not in env and not ("PMI_RANK" in env and "PMI_LOCAL_RANK" in env):
        return None
    if "PMI_SIZE" not in env and _in_srun_step(env, "PALS_RANKID"):
        return None  # Slurm's cray_shasta plugin (Perlmutter, Frontier): a plain srun task
    rank = _int(env, "PALS_RANKID", "PMI_RANK", "PMIX_RANK")
    local_world = _int(env, "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE")
    world = _int(env, "PMI_SIZE")
    notes: tuple[str, ...] = ()
    if world is None and local_world is not None and env.get("PBS_NODEFILE"):
        # `mpiexec --pmi=pmix` (ALCF users' Aurora scripts) exports no PMI_SIZE; PALS
        # places --ppn ranks on every node of the job, so the node file gives the rest.
        nodes = len(unique(job_hosts(env)))
        world = nodes * local_world
        notes = (
            f"pals: PMI_SIZE is not set (PMIx); world size {world} = {nodes} node(s) in "
            f"PBS_NODEFILE x {local_world} ranks per node (mpiexec must use every node "
            "with the same --ppn)",
        )
    return _build(
        env,
        "pals",
        rank,
        world,
        _int(env, "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
        local_world,
        _int(env, "PALS_NODEID"),
        "PALS_RANKID" if "PALS_RANKID" in env else "PMI_RANK",
        "PMI_SIZE",
        local_pid_ok=True,
        notes=notes,
    )


def _lsf(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "JSM_NAMESPACE_RANK" not in env:
        return None
    return _build(
        env,
        "lsf",
        _int(env, "JSM_NAMESPACE_RANK"),
        _int(env, "JSM_NAMESPACE_SIZE"),
        _int(env, "JSM_NAMESPACE_LOCAL_RANK"),
        _int(env, "JSM_NAMESPACE_LOCAL_SIZE"),
        None,
        "JSM_NAMESPACE_RANK",
        "JSM_NAMESPACE_SIZE",
    )


def _openmpi(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    # OMPI_COMM_WORLD_NODE_RANK is the rank among this node's processes of *all* jobs,
    # not a node index, so the node rank is derived from the local size.
    return _build(
        env,
        "openmpi",
        _int(env, "OMPI_COMM_WORLD_RANK"),
        _int(env, "OMPI_COMM_WORLD_SIZE"),
        _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        None,
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        local_pid_ok=True,
    )


def _mvapich(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "MV2_COMM_WORLD_RANK" not in env:
        return None
    return _build(
        env,
        "mvapich",
        _int(env, "MV2_COMM_WORLD_RANK"),
        _int(env, "MV2_COMM_WORLD_SIZE"),
        _int(env, "MV2_COMM_WORLD_LOCAL_RANK"),
        _int(env, "MV2_COMM_WORLD_LOCAL_SIZE"),
        None,
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        local_pid_ok=True,
    )


def _mpich(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "PMI_RANK" not in env:
        return None
    if "MPI_LOCALRANKID" not in env and _in_srun_step(env, "PMI_RANK"):
        return None  # `srun --mpi=pmi2`: SLURM's variables know the local rank, PMI's do not
    return _build(
        env,
        "mpich",
        _int(env, "PMI_RANK"),
        _int(env, "PMI_SIZE"),
        _int(env, "MPI_LOCALRANKID"),
        _int(env, "MPI_LOCALNRANKS"),
        None,
        "PMI_RANK",
        "PMI_SIZE",
        local_pid_ok=True,
    )


#: SLURM_BATCH_SCRIPT (0xfffffffe) and SLURM_EXTERN_CONT (0xffffffff) step ids.
_SLURM_NON_TASK_STEPS = ("4294967294", "4294967295", "batch", "extern")


def _slurm_step(env: Mapping[str, str]) -> bool:
    """True in a task of an srun step (not the batch shell, not the extern step)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return step is not None and step not in _SLURM_NON_TASK_STEPS and "SLURM_PROCID" in env


def _slurm(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env:
        return None
    # srun exports the step's own task count; the job's SLURM_NTASKS is the fallback.
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if not _slurm_step(env):
        if ntasks is not None and ntasks > 1:
            raise ConfigError(
                f"slurm: this is the batch shell of a job with SLURM_NTASKS={ntasks}, but "
                "python was not started by srun, so the other ranks would never come; "
                "launch with `srun python ...` (or set DDP_LAUNCHER=single to run one process)"
            )
        return None  # salloc/sbatch shell with one task: a plain single process
    node_id = _int(env, "SLURM_NODEID")
    local_world = None
    tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if tpn:
        counts = parse_tasks_per_node(tpn)
        if node_id is not None and node_id < len(counts):
            local_world = counts[node_id]
    return _build(
        env,
        "slurm",
        _int(env, "SLURM_PROCID"),
        ntasks,
        _int(env, "SLURM_LOCALID"),
        local_world,
        node_id,
        "SLURM_PROCID",
        "SLURM_NTASKS",
    )


def _single(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv:
    addr = env.get("MASTER_ADDR") or "localhost"
    port = _int(env, "MASTER_PORT") or DEFAULT_PORT
    return DistEnv(0, 0, 1, 1, 0, addr, port, "single")


Detector = Callable[[Mapping[str, str], Sequence[str]], "DistEnv | None"]

#: The fixed priority order; the first detector that recognises its launcher wins.
DETECTORS: dict[str, Detector] = {
    "torchrun": _torchrun,
    "legacy": _legacy,
    "pals": _pals,
    "lsf": _lsf,
    "openmpi": _openmpi,
    "mvapich": _mvapich,
    "mpich": _mpich,
    "slurm": _slurm,
    "single": _single,
}

#: Launchers a process manager starts every rank of (as opposed to RANK/WORLD_SIZE
#: that anyone can export); their answer is the one a stale RANK must agree with.
_SCHEDULED = ("pals", "lsf", "openmpi", "mvapich", "mpich", "slurm")

#: Variables in which a launcher says how many processes it started (in all, or on
#: this node). Any of them above 1 means this process is not alone.
_SIZE_VARS = (
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "PMI_SIZE",
    "PMI_LOCAL_SIZE",
    "PALS_LOCAL_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE",
    "JSM_NAMESPACE_SIZE",
    "JSM_NAMESPACE_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
)


def _scheduler_view(env: Mapping[str, str], args: Sequence[str]) -> DistEnv | None:
    """What the process manager itself says about this process, if anything."""
    for name in _SCHEDULED:
        try:
            found = DETECTORS[name](env, args)
        except ConfigError:
            return None  # its own variables are incomplete: nothing reliable to compare
        if found is not None:
            return found
    return None


def _check_not_stale(found: DistEnv, env: Mapping[str, str], args: Sequence[str]) -> None:
    """RANK/WORLD_SIZE without torchrun's TORCHELASTIC_RUN_ID must fit the scheduler's view."""
    if found.launcher not in ("torchrun", "legacy") or "TORCHELASTIC_RUN_ID" in env:
        return
    sched = _scheduler_view(env, args)
    if sched is None:
        return
    # A launcher nested in each scheduler task (torch.distributed.launch under
    # `srun -n 1`, pytorch-ignite's case 2) starts k = WORLD_SIZE / tasks workers per
    # task, block-placed: then RANK // k is the task's own rank. Anything else is stale.
    per_task, rest = divmod(found.world_size, sched.world_size)
    if per_task >= 1 and rest == 0 and found.rank // per_task == sched.rank:
        return
    raise ConfigError(
        f"stale launcher variables: RANK={found.rank} WORLD_SIZE={found.world_size} (no "
        f"TORCHELASTIC_RUN_ID, so not set by torchrun) contradict {sched.launcher}, which "
        f"started this process as rank {sched.rank} of {sched.world_size}; unset RANK, "
        f"LOCAL_RANK and WORLD_SIZE before launching, or set DDP_LAUNCHER={sched.launcher} "
        "(or torchrun) to choose"
    )


def _check_not_alone(env: Mapping[str, str]) -> None:
    """A world of 1 while some launcher says there are more processes: refuse."""
    names = list(_SIZE_VARS)
    if _slurm_step(env):
        names.append("SLURM_STEP_NUM_TASKS")
    for name in names:
        raw = env.get(name, "")
        if raw.strip().isdigit() and int(raw) > 1:
            raise ConfigError(
                f"{name}={raw} says this job has more than one process, but no launcher's "
                "rank variables were found, so this process would train alone and write the "
                "same checkpoints as its peers; launch with a supported launcher (torchrun, "
                "srun, mpiexec, jsrun, mpirun_rsh) or set DDP_LAUNCHER to choose one"
            )


def detect(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> DistEnv:
    """Find rank, world and master address from whichever launcher started this process.

    ``environ`` defaults to ``os.environ`` and ``argv`` to ``sys.argv`` (read only
    for the legacy ``--local_rank`` flag). Raises :class:`ConfigError` with one
    clear line for inconsistent, incomplete, stale or unrecognised launcher variables.
    """
    env = os.environ if environ is None else environ
    args = sys.argv[1:] if argv is None else argv
    forced = env.get("DDP_LAUNCHER", "").strip().lower()
    if forced and forced != "auto":
        if forced not in DETECTORS:
            raise ConfigError(
                f"DDP_LAUNCHER={forced!r} is not a known launcher; allowed: auto, "
                + ", ".join(DETECTORS)
            )
        found = DETECTORS[forced](env, args)
        if found is None:
            raise ConfigError(f"DDP_LAUNCHER={forced}: none of that launcher's variables are set")
        return found
    for detector in DETECTORS.values():
        found = detector(env, args)
        if found is not None:
            break
    assert found is not None, "the single-process detector always answers"
    _check_not_stale(found, env, args)
    if found.world_size == 1:
        _check_not_alone(env)
    return found


# ---- the collective timeout from the environment -----------------------------------------
TIMEOUT_VARS = ("DDP_TIMEOUT", "NCCL_TIMEOUT")
"""Where a collective timeout in seconds may come from, first wins. ``NCCL_TIMEOUT`` is
what seeds 002 and 003 tell their users to export (``export NCCL_TIMEOUT=1800``, in
seconds); NCCL itself reads no such variable, so without this it was silently ignored.
``DDP_TIMEOUT`` is this project's own name and wins when both are set."""


def timeout_from_environ(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """``(variable, raw value)`` of the first non-empty :data:`TIMEOUT_VARS`, else None.

    The caller parses and bounds the value (``ddp.dist._timeout``) so a bad one is one
    line naming the variable it came from."""
    env = os.environ if environ is None else environ
    for name in TIMEOUT_VARS:
        raw = env.get(name, "").strip()
        if raw:
            return name, raw
    return None
