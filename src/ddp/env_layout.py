"""The layout arithmetic behind :func:`ddp.env.detect`: the :class:`DistEnv` record, the
master's address and port from the job id and host list, and the local rank and ranks per
node derived from the host list only where block placement makes them certain.

Split from :mod:`ddp.env` (which re-exports these names): the launcher detectors there read
each launcher's variables and hand the numbers to :func:`_build` here. The module docstring
of :mod:`ddp.env` describes the rules as a user meets them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddp.errors import ConfigError
from ddp.hostlist import job_hosts, short, unique

# The port rule is both sides' (hpc_ddp.ports); re-exported: ddp.env.X is what callers name.
from hpc_ddp.ports import (  # noqa: F401  (DEFAULT_PORT, PORT_BASE, PORT_SPAN: ddp.env re-exports)
    DEFAULT_PORT,
    PORT_BASE,
    PORT_SPAN,
    job_number,
    port_for,
    valid_port,
)
from hpc_ddp.torchrun_vars import torchrun_vars as _torchrun_vars


@dataclass(frozen=True)
class DistEnv:
    """What a process knows about its place in the job, launcher-independent.

    ``local_world_size`` and ``node_rank`` are ``None`` when the launcher does not
    say and the layout cannot be derived without guessing; ``notes`` carries the
    one-line explanations rank 0 logs once.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int | None
    node_rank: int | None
    master_addr: str
    master_port: int
    launcher: str
    notes: tuple[str, ...] = ()

    @property
    def num_nodes(self) -> int | None:
        """Nodes running ranks of this launch (torchrun's GROUP_WORLD_SIZE), if known."""
        if self.local_world_size is None:
            return None
        return max(1, -(-self.world_size // max(1, self.local_world_size)))

    def torchrun_vars(self, full: bool = False) -> dict[str, str]:
        """The variables torchrun would have set for this process.

        The default set is what ``env://`` initialisation reads. ``full=True`` adds
        the rest of what torch's elastic agent exports (``local_elastic_agent.py``),
        so that ``torch.distributed.is_torchelastic_launched()`` is true and scripts
        reading GROUP_WORLD_SIZE or ROLE_* run unchanged. Values that are not known
        (see the class docstring) are left out rather than guessed.
        """
        return _torchrun_vars(
            rank=self.rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            master_addr=self.master_addr,
            master_port=self.master_port,
            local_world_size=self.local_world_size,
            node_rank=self.node_rank,
            num_nodes=self.num_nodes,
            full=full,
        )


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


#: Where schedulers and launchers put the job's id, in the order they are trusted.
_JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "OMPI_MCA_ess_base_jobid", "LSB_JOBID")


def job_id(env: Mapping[str, str]) -> str | None:
    """The scheduler's id of this job, as the scheduler writes it."""
    for name in _JOB_ID_VARS:
        if env.get(name):
            return env[name]
    return None


def _job_id_number(env: Mapping[str, str]) -> int | None:
    for name in _JOB_ID_VARS:
        number = job_number(env.get(name, ""))
        if number is not None:
            return number
    return None


def _master(
    env: Mapping[str, str], hosts: list[str], multi_node: bool, launcher: str, local_pid_ok: bool
) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR")
    if not addr:
        if hosts:
            suffix = env.get("DDP_MASTER_ADDR_SUFFIX", "")
            # Node files may hold full names (x4415c6s5b0n0.hostmgmt2415.cm...): the site
            # suffix replaces the domain, it is not appended to it.
            addr = short(hosts[0]) + suffix if suffix else hosts[0]
        elif multi_node:
            raise ConfigError(
                f"{launcher}: the job spans several nodes but MASTER_ADDR is not set and there "
                "is no PBS_NODEFILE, LSF rank file or SLURM node list to take it from; export "
                "MASTER_ADDR=<host of rank 0>"
            )
        else:
            addr = "localhost"
    port = _int(env, "MASTER_PORT")
    if port is None:
        job = _job_id_number(env)
        if job is None and local_pid_ok and not multi_node:
            job = os.getppid()
        port = port_for(job)
    if not valid_port(port):
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


def _hostname() -> str:
    return short(socket.gethostname())


def _layout(
    hosts: list[str],
    launcher: str,
    rank: int,
    world: int,
    local_rank: int | None,
    local_world: int | None,
    node_rank: int | None,
) -> tuple[int, int | None, int | None, tuple[str, ...]]:
    """(local rank, ranks per node, node rank, notes), the same on every node.

    The launcher's own per-node variables win. Without a local size:

    - one host in the job's host list: every rank is on it;
    - several hosts and no local rank either: block placement (rank // ppn on node
      rank // ppn, the default of mpiexec ``--ppn``, PALS and jsrun) when the world
      divides evenly over the hosts and this rank's host agrees; otherwise no rank
      can know its device, so it stops with one line;
    - several hosts and a local rank: the ranks per node stay unknown on every
      rank (a per-rank guess would differ between nodes), said once in the log.
    """
    if local_world is not None:
        if local_rank is None:
            local_rank = rank % local_world
        if node_rank is None:
            node_rank = rank // local_world
        return local_rank, local_world, node_rank, ()
    nodes = [short(h) for h in unique(hosts)]
    here = _hostname()
    host_index = nodes.index(here) if here in nodes else None
    if len(nodes) == 1 and local_rank in (None, rank) and node_rank in (None, 0):
        return rank, world, 0, ()
    if local_rank is None:
        ppn = world // len(nodes) if nodes and world % len(nodes) == 0 else 0
        if ppn and host_index in (None, rank // ppn) and node_rank in (None, rank // ppn):
            return rank % ppn, ppn, rank // ppn, ()
        raise ConfigError(
            f"{launcher}: this rank's local rank is not set and the placement of {world} ranks "
            f"over {len(nodes) or 'an unknown number of'} node(s) cannot be derived; launch "
            "with the same number of ranks on every node of the job (--ppn) or export LOCAL_RANK"
        )
    if node_rank is None:
        node_rank = host_index
    note = (
        f"{launcher}: the launcher does not say how many ranks run per node; LOCAL_WORLD_SIZE"
        + ("" if node_rank is not None else " and GROUP_RANK")
        + " are left unset instead of guessed"
    )
    return local_rank, None, node_rank, (note,)


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
    notes: tuple[str, ...] = (),
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
    # The host list is read only when needed: a stale PBS_NODEFILE must not break a
    # launch whose layout and master are fully given.
    hosts = job_hosts(env) if local_world is None or not env.get("MASTER_ADDR") else []
    local_rank, local_world, node_rank, more = _layout(
        hosts, launcher, rank, world, local_rank, local_world, node_rank
    )
    if local_world is not None and not 0 <= local_rank < max(local_world, 1):
        raise ConfigError(
            f"{launcher}: local rank {local_rank} is not below the local world size {local_world}"
        )
    if local_world is not None:
        multi_node = local_world < world
    else:
        multi_node = local_rank != rank or len(unique(hosts)) > 1
    addr, port = _master(env, hosts, multi_node, launcher, local_pid_ok)
    return DistEnv(
        rank, local_rank, world, local_world, node_rank, addr, port, launcher, notes + more
    )
