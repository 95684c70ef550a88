"""Who am I? Launcher detection for the compute node.

Every launcher tells a process its rank in its own variables. ``detect()`` reads
them in a fixed priority order and returns one :class:`DistEnv`:

1. ``DDP_LAUNCHER`` forces a detector by name (``single`` included).
2. ``torchrun`` (and ``torch.distributed.launch``): RANK / WORLD_SIZE / LOCAL_RANK.
   Checked first, so torchrun started inside a SLURM or PBS job wins.
3. ``legacy``: ``torch.distributed.launch`` without ``--use-env`` passes
   ``--local_rank=N`` / ``--local-rank=N`` on the command line, RANK/WORLD_SIZE in env.
4. ``pals``: Aurora/Polaris PALS ``mpiexec`` (PALS_RANKID, PALS_LOCAL_RANKID,
   PMI_RANK, PMI_SIZE, PMI_LOCAL_RANK).
5. ``openmpi``: OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}.
6. ``mpich``: MPICH hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS).
7. ``slurm``: a task started by ``srun`` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
   SLURM_NODEID, SLURM_STEP_ID). A SLURM *batch shell* running python without
   srun while SLURM_NTASKS > 1 is refused: it would wait forever for ranks that
   never start.
8. ``single``: no launcher; world size 1.

Master address: MASTER_ADDR if set, else the first host of PBS_NODEFILE, else
the first host of the SLURM node list, else ``localhost``. When derived from a
host list, ``DDP_MASTER_ADDR_SUFFIX`` is appended (Aurora's high-speed network
names, e.g. ``.hsn.cm.aurora.alcf.anl.gov``).

Master port: MASTER_PORT if set, else derived from the job id
(SLURM_JOB_ID, PBS_JOBID, Open MPI's job id) as ``20000 + id % 9000``, so every
rank computes the same port in 20000-28999 (below Linux's ephemeral range), and
two jobs sharing a node rarely collide. A single-node MPI run with no job id
uses its launcher proxy's pid (the common parent of all its ranks) the same way;
otherwise 29500.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from ddp.errors import ConfigError

DEFAULT_PORT = 29500
PORT_BASE = 20000
PORT_SPAN = 9000


@dataclass(frozen=True)
class DistEnv:
    """What a process knows about its place in the job, launcher-independent."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // max(1, self.local_world_size)))

    def torchrun_vars(self) -> dict[str, str]:
        """The variables torchrun would have set for this process (``env://`` init reads them)."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


# --------------------------------------------------------------------------- host lists


def _expand_item(item: str) -> list[str]:
    """Expand one host expression with any number of bracket groups (cartesian product)."""
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        if "[" in item or "]" in item:
            raise ConfigError(f"node list: unbalanced brackets in {item!r}")
        return [item]
    head, body, tail = item[: m.start()], m.group(1), item[m.end() :]
    values: list[str] = []
    for part in body.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ConfigError(f"node list: bad range {part!r} in {item!r}")
            width = len(lo)
            values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            values.append(part)
    return [head + v + rest for v in values for rest in _expand_item(tail)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM compressed host list, e.g. ``nid[001002-001004,001010],login1``.

    Zero padding is kept (``nid[08-10]`` -> nid08, nid09, nid10), several bracket
    groups in one name expand as a product, and commas inside brackets do not
    split hosts.
    """
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list: unbalanced brackets in {nodelist!r}")
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"node list: unbalanced brackets in {nodelist!r}")
    items.append(nodelist[start:])
    hosts: list[str] = []
    for item in items:
        item = item.strip()
        if item:
            hosts.extend(_expand_item(item))
    return hosts


def _parse_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE (``2(x3),1``) into one count per node."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"SLURM_TASKS_PER_NODE: cannot parse {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# --------------------------------------------------------------------------- helpers


def _int(env: Mapping[str, str], *names: str) -> int | None:
    """First of ``names`` present in env as an int; a non-integer value is a clear error."""
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not an integer") from None
    return None


def _job_id_number(env: Mapping[str, str]) -> int | None:
    for name in ("SLURM_JOB_ID", "PBS_JOBID", "OMPI_MCA_ess_base_jobid", "LSB_JOBID"):
        raw = env.get(name, "")
        m = re.match(r"\d+", raw)
        if m:
            return int(m.group(0))
    return None


def _first_host(env: Mapping[str, str]) -> str | None:
    nodefile = env.get("PBS_NODEFILE")
    if nodefile:
        try:
            with open(nodefile, encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        return line.strip()
        except OSError as exc:
            raise ConfigError(f"PBS_NODEFILE={nodefile!r} cannot be read: {exc.strerror}") from None
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            hosts = expand_nodelist(env[name])
            if hosts:
                return hosts[0]
    return None


def _master(
    env: Mapping[str, str], multi_node: bool, launcher: str, local_pid_ok: bool
) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR")
    if not addr:
        host = _first_host(env)
        if host is not None:
            suffix = env.get("DDP_MASTER_ADDR_SUFFIX", "")
            # Node files may hold full names (x4415c6s5b0n0.hostmgmt2415.cm...): the site
            # suffix replaces the domain, it is not appended to it.
            addr = host.split(".")[0] + suffix if suffix else host
        elif multi_node:
            raise ConfigError(
                f"{launcher}: the job spans several nodes but MASTER_ADDR is not set and there "
                "is no PBS_NODEFILE or SLURM node list to take it from; export MASTER_ADDR=<host "
                "of rank 0>"
            )
        else:
            addr = "localhost"
    port = _int(env, "MASTER_PORT")
    if port is None:
        job = _job_id_number(env)
        if job is None and local_pid_ok and not multi_node:
            job = os.getppid()
        port = DEFAULT_PORT if job is None else PORT_BASE + job % PORT_SPAN
    if not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is out of range; allowed: 1-65535")
    return addr, port


def _legacy_local_rank(argv: Sequence[str]) -> int | None:
    for i, arg in enumerate(argv):
        for flag in ("--local_rank", "--local-rank"):
            if arg == flag and i + 1 < len(argv):
                return int(argv[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return None


def _build(
    env: Mapping[str, str],
    launcher: str,
    rank: int | None,
    world: int | None,
    local_rank: int | None,
    local_world: int | None,
    node_rank: int | None,
    rank_var: str,
    world_var: str,
    local_pid_ok: bool = False,
) -> DistEnv:
    """Fill the gaps a launcher leaves and check the values agree with each other."""
    if rank is None:
        raise ConfigError(f"{launcher}: {rank_var} is not set")
    if world is None:
        raise ConfigError(
            f"{launcher}: {rank_var}={rank} is set but {world_var} (the world size) is missing"
        )
    if world < 1:
        raise ConfigError(f"{launcher}: {world_var}={world}; allowed: an integer >= 1")
    if not 0 <= rank < world:
        raise ConfigError(
            f"{launcher}: {rank_var}={rank} is not below {world_var}={world}; allowed: 0..{world - 1}"
        )
    if local_rank is None:
        local_rank = rank if local_world in (None, world) else rank % local_world
    if local_world is None:
        local_world = world if local_rank == rank else local_rank + 1
    if not 0 <= local_rank < max(local_world, 1):
        raise ConfigError(
            f"{launcher}: local rank {local_rank} is not below the local world size {local_world}"
        )
    if node_rank is None:
        node_rank = rank // local_world if local_world else 0
    multi_node = local_world < world
    addr, port = _master(env, multi_node, launcher, local_pid_ok)
    return DistEnv(rank, local_rank, world, local_world, node_rank, addr, port, launcher)


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
        env, "legacy", _int(env, "RANK"), _int(env, "WORLD_SIZE"), local, None,
        _int(env, "GROUP_RANK", "NODE_RANK"), "RANK", "WORLD_SIZE",
    )  # fmt: skip


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
    rank_local = _int(env, "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK")
    local_world = _int(env, "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE")
    if local_world is None and env.get("PBS_NODEFILE"):
        # No local size exported: PBS gives one line per node, so guess an even spread,
        # never below what this rank's own local rank proves.
        world = _int(env, "PMI_SIZE")
        try:
            with open(env["PBS_NODEFILE"], encoding="utf-8") as fh:
                nodes = sum(1 for line in fh if line.strip())
        except OSError:
            nodes = 0
        if world and nodes:
            local_world = max(-(-world // nodes), (rank_local or 0) + 1)
    return _build(
        env, "pals", _int(env, "PALS_RANKID", "PMI_RANK"), _int(env, "PMI_SIZE"),
        rank_local, local_world, _int(env, "PALS_NODEID"), "PMI_RANK", "PMI_SIZE",
        local_pid_ok=True,
    )  # fmt: skip


def _openmpi(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    return _build(
        env, "openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
        _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        None, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", local_pid_ok=True,
    )  # fmt: skip


def _mpich(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "PMI_RANK" not in env:
        return None
    if "MPI_LOCALRANKID" not in env and _in_srun_step(env, "PMI_RANK"):
        return None  # `srun --mpi=pmi2`: SLURM's variables know the local rank, PMI's do not
    return _build(
        env, "mpich", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
        _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"), None,
        "PMI_RANK", "PMI_SIZE", local_pid_ok=True,
    )  # fmt: skip


#: SLURM_BATCH_SCRIPT (0xfffffffe) and SLURM_EXTERN_CONT (0xffffffff) step ids.
_SLURM_NON_TASK_STEPS = ("4294967294", "4294967295", "batch", "extern")


def _slurm(env: Mapping[str, str], argv: Sequence[str]) -> DistEnv | None:
    if "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env:
        return None
    # srun exports the step's own task count; the job's SLURM_NTASKS is the fallback.
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    # The batch shell and the extern step carry reserved ids where a SLURM exports them.
    in_step = step is not None and step not in _SLURM_NON_TASK_STEPS
    if not in_step or "SLURM_PROCID" not in env:
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
        counts = _parse_tasks_per_node(tpn)
        if node_id is not None and node_id < len(counts):
            local_world = counts[node_id]
    return _build(
        env, "slurm", _int(env, "SLURM_PROCID"), ntasks, _int(env, "SLURM_LOCALID"),
        local_world, node_id, "SLURM_PROCID", "SLURM_NTASKS",
    )  # fmt: skip


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
    "openmpi": _openmpi,
    "mpich": _mpich,
    "slurm": _slurm,
    "single": _single,
}


def detect(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> DistEnv:
    """Find rank, world and master address from whichever launcher started this process.

    ``environ`` defaults to ``os.environ`` and ``argv`` to ``sys.argv`` (read only
    for the legacy ``--local_rank`` flag). Raises :class:`ConfigError` with one
    clear line for inconsistent or incomplete launcher variables.
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
            return found
    raise AssertionError("the single-process detector always answers")


def hostname() -> str:
    """This host's short name, as launchers and node files usually write it."""
    return socket.gethostname().split(".")[0]
