"""hpc: the login-node side of hpc-ddp (job specs, cluster profiles, templates, schedulers).

Importing ``hpc`` must stay cheap: it never imports torch or submitit at module
level, so ``hpc render`` runs in milliseconds on a login node.
"""

from __future__ import annotations

from typing import Any

from hpc.errors import UserError

__all__ = ["UserError", "__version__", "distributed", "executor"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``hpc.executor`` / ``hpc.distributed`` (hpc.executors) load on first use, not at import."""
    if name in ("executor", "distributed"):
        from hpc import executors

        return getattr(executors, name)
    raise AttributeError(f"module 'hpc' has no attribute {name!r}")
