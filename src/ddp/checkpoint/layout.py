"""The on-disk layout of a checkpoint directory: names, pointer, digest sidecar, version.

``<dir>/step_<N>.pt`` plus ``step_<N>.pt.sha256`` (the digest of its bytes) and
``step_<N>.ranks/`` (one small file per rank); a sharded checkpoint is the directory
``step_<N>`` with ``meta.pt`` and torch.distributed.checkpoint's shard files;
``<dir>/latest`` names the newest complete one.
"""

import re

LATEST = "latest"
DIGEST_SUFFIX = ".sha256"
_STEP_RE = re.compile(r"^step_(\d+)(\.pt)?\Z")  # a file, or a sharded checkpoint's directory
META = "meta.pt"  # in a sharded checkpoint: everything but the shards (ddp.checkpoint.manager)
FORMAT_VERSION = 3  # 2: sha256 sidecar, RNG states as plain values (weights_only loads)
# 3: each rank's state in its own rank file (``rank_files``), no gathered ``rng`` list
RANK_FILE_LIMIT = 1 << 20
"""At most this many bytes in one rank file (about 13 KB when sound: RNG states)."""
_RANK_HEADER = b"ddp-rank-state sha256="


#: What a sharded checkpoint's shard files may be called: torch.distributed.checkpoint's
#: per-rank data files and its metadata file (nothing with a path in it).
_SHARD_RE = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)\Z")
