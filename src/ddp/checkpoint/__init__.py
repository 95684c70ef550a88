"""Checkpoints: the file format, the directory lock, the manager and sharded saves.

The package's parts, by what each owns:

- :mod:`ddp.checkpoint.layout`: the on-disk names and the format version;
- :mod:`ddp.checkpoint.files`: atomic, durable writes; bounded reads of untrusted files;
- :mod:`ddp.checkpoint.format`: the names, listing, removal and pruning of checkpoints;
  RNG and model state; :mod:`ddp.checkpoint.format_write`: save and stage checkpoints,
  each rank's own file, the final export; :mod:`ddp.checkpoint.format_read`: the resume
  lookup, loading and checking a checkpoint and each rank's file;
- :mod:`ddp.checkpoint.checks`: what a loaded checkpoint may hold, field by field;
- :mod:`ddp.checkpoint.lock`: one live run per directory (``.ddp-lock``);
- :mod:`ddp.checkpoint.manager`: the trainer's ``Checkpointer`` (state keys, background
  saves, resume, the checks that a checkpoint fits this run), written in parts:
  :mod:`~ddp.checkpoint.manager_base` (lock, pending save, the ranks' agreement),
  :mod:`~ddp.checkpoint.manager_save` (save and export),
  :mod:`~ddp.checkpoint.manager_resume` (load, restore, resume checks, hyper-parameters
  reapplied), :mod:`~ddp.checkpoint.manager_best` (``checkpoint.best``); the counters it
  saves as state objects (``TrainState``, ``LoopState``) in :mod:`ddp.checkpoint.loop`;
- :mod:`ddp.checkpoint.sharded`: FSDP2's sharded saves through torch.distributed.checkpoint.

``ddp.checkpoint`` itself offers the format's functions (``from ddp.checkpoint import
atomic_save``), as the single module it replaces did; the manager is imported from its
module (it imports the trainer's config and FSDP, which the format does not need).
"""

from __future__ import annotations

from ddp.checkpoint.checks import (  # noqa: F401
    FIELDS,
    TRAINER_FIELDS,
    check_fields,
    check_like,
    check_rng_state,
    check_same_model,
)
from ddp.checkpoint.files import (  # noqa: F401
    SMALL_FILE,
    atomic_save,
    atomic_save_digested,
    atomic_write_text,
    fsync_dir,
    read_regular,
    sha256_file,
    write_error,
)
from ddp.checkpoint.format import (  # noqa: F401
    list_checkpoints,
    model_state,
    prune,
    rank_dir,
    rank_file_name,
    remove_checkpoint,
    remove_stale_staging,
    rng_state,
    set_rng_state,
    sharded_path,
    staging_path,
    step_path,
)
from ddp.checkpoint.format_read import (  # noqa: F401
    RANK_FIELDS,
    check_shards,
    find_latest,
    load_checkpoint,
    load_latest,
    read_checkpoint,
    read_rank_state,
    readable_checkpoints,
)
from ddp.checkpoint.format_write import (  # noqa: F401
    PendingSave,
    StagedCheckpoint,
    begin_save,
    export_final,
    save_checkpoint,
    save_error,
    stage_save,
    write_rank_state,
)
from ddp.checkpoint.layout import (  # noqa: F401
    DIGEST_SUFFIX,
    FORMAT_VERSION,
    LATEST,
    META,
    RANK_FILE_LIMIT,
)
from ddp.checkpoint.lock import (  # noqa: F401
    LOCK,
    LOCK_REFRESH_S,
    LOCK_STALE_BEATS,
    DirLock,
)
