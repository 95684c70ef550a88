"""The variables torchrun exports to each rank, as one function both sides build them with.

``env://`` initialisation reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; LOCAL_RANK
and LOCAL_WORLD_SIZE place a rank on its node; GROUP_RANK is torchrun's node index (and
NODE_RANK, not torchrun's, is what Lightning reads). The compute side exports them under
every other launcher (``ddp.exec``, ``DistEnv.torchrun_vars``); the login side's Python
API exports them for submitit's local tasks (``hpc.executors.ranks``). Source: torch's
elastic agent, ``torch/distributed/elastic/agent/server/local_elastic_agent.py``.
"""

from __future__ import annotations

#: What ``env://`` and a rank's placement need (the default set).
BASIC = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
)

#: The rest of what torch's elastic agent exports (``full=True``), so that
#: ``torch.distributed.is_torchelastic_launched()`` is true and scripts reading
#: GROUP_WORLD_SIZE or ROLE_* run unchanged.
ELASTIC = (
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def torchrun_vars(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    local_world_size: int | None = None,
    node_rank: int | None = None,
    num_nodes: int | None = None,
    full: bool = False,
) -> dict[str, str]:
    """The variables torchrun would set for this rank (:data:`BASIC`; with ``full``,
    :data:`ELASTIC` too). A value that is not known (None) is left out, never guessed."""
    out = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    if local_world_size is not None:
        out["LOCAL_WORLD_SIZE"] = str(local_world_size)
    if node_rank is not None:
        out["GROUP_RANK"] = str(node_rank)
        out["NODE_RANK"] = str(node_rank)
    if not full:
        return out
    if num_nodes is not None:
        out["GROUP_WORLD_SIZE"] = str(num_nodes)
    out.update(
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        ROLE_NAME="default",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        # No agent hosts a store: rank 0 does, as under torchrun's static rendezvous.
        TORCHELASTIC_USE_AGENT_STORE="False",
    )
    return out
