"""ddp: the compute-node side of hpc-ddp.

One training script, written once, runs under plain python, torchrun, srun,
MPICH, Open MPI and Aurora's PALS mpiexec::

    import ddp
    ctx = ddp.init()                 # rank, device and backend from any launcher
    model = ddp.wrap(MyModel())      # DDP when world > 1, the plain model otherwise
    ...
    ddp.shutdown()

Importing ``ddp`` imports torch lazily: only ``init()`` and the helpers that
touch tensors pull it in, so ``import ddp`` itself costs next to nothing.
"""

from __future__ import annotations

from ddp.dist import (
    Context,
    all_gather_object,
    barrier,
    broadcast_object,
    get_context,
    get_rank,
    get_world_size,
    init,
    is_main_process,
    print0,
    reduce_mean,
    reduce_sum,
    shutdown,
    unwrap,
    wrap,
)
from ddp.env import DistEnv, detect
from ddp.errors import ConfigError

__all__ = [
    "ConfigError",
    "Context",
    "DistEnv",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "detect",
    "get_context",
    "get_rank",
    "get_world_size",
    "init",
    "is_main_process",
    "print0",
    "reduce_mean",
    "reduce_sum",
    "shutdown",
    "unwrap",
    "wrap",
]
__version__ = "0.1.0"
