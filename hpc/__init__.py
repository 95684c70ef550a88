"""hpc: the login-node side of hpc-ddp (job specs, cluster profiles, templates, schedulers).

Importing ``hpc`` must stay cheap: it never imports torch or submitit at module
level, so ``hpc render`` runs in milliseconds on a login node.
"""

from __future__ import annotations

from hpc.errors import UserError

__all__ = ["UserError", "__version__"]
__version__ = "0.1.0"
