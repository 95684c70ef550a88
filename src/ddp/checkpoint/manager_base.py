"""What every part of the :class:`~ddp.checkpoint.manager.Checkpointer` shares.

The run's directory and its lock, the save that may still be running, and the one
agreement the ranks make about a save or a resume (:meth:`CheckpointerBase._first`: one
all-reduce of one integer). The save path (:mod:`ddp.checkpoint.manager_save`), the resume
path (:mod:`ddp.checkpoint.manager_resume`) and the best model (:mod:`ddp.checkpoint.manager_best`)
build on it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import ddp
from ddp import checkpoint as ckpt
from ddp.config import TrainConfig
from ddp.dist import Context
from ddp.errors import ConfigError

if TYPE_CHECKING:
    from ddp.checkpoint.manager_best import BestValue

_NOBODY = 1 << 62
"""What :meth:`CheckpointerBase._first` reads as "no rank reported anything"."""


class CheckpointerBase:
    """The state and the collectives that saving, resuming and the best model share."""

    def __init__(self, config: TrainConfig, ctx: Context, background: bool = True) -> None:
        """``background``: finish each save in a thread while training goes on (the
        default: the plain file's fsync, rename and ``latest``; a sharded checkpoint's
        whole write, through DCP's ``async_save``). False: every save is complete when
        :meth:`save` returns (benchmarks, debugging)."""
        self.config = config
        self.ctx = ctx
        self.dir = config.checkpoint.dir
        self.background = background
        self._group: Any = None  # the Gloo group of background sharded saves
        self._lock: ckpt.DirLock | None = None
        self._pending: ckpt.PendingSave | None = None
        self.resumed_from = ""
        #: checkpoint.best's value so far (``Best.keep_best``; None until its first call)
        self.best: BestValue | None = None

    def _directory(self) -> Path:
        """``checkpoint.dir`` for the methods called only once it is known to be set."""
        assert self.dir is not None
        return Path(self.dir)

    # ---- lifetime -----------------------------------------------------------------------
    def open(self) -> None:
        """Collective: rank 0 locks the directory; every rank stops with its line if not.

        Also the early check that the directory is writable at all: a read-only one is
        reported now, not after the first epoch's work."""
        if not self.dir:
            return
        error = None
        if self.ctx.is_main:
            try:
                self._lock = ckpt.DirLock.acquire(self.dir)
            except ConfigError as exc:
                error = str(exc)
        error = ddp.broadcast_object(error)
        if error:
            raise ConfigError(error)

    def wait(self, timeout: float | None = None) -> None:
        """Finish a background save (raising its error); at most ``timeout`` seconds."""
        if self._pending is not None and self._pending.wait(timeout):
            self._pending = None

    def close(self, timeout: float | None = None) -> None:
        """Finish the last save (never leave one half-finalized), then free the directory."""
        with contextlib.suppress(Exception):
            self.wait(timeout)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _first(self, mine: int | None, group: Any = None) -> int | None:
        """Collective: the smallest of every rank's ``mine`` (None: nothing to report), in
        one all-reduce of one integer, on ``group`` (a Gloo group: a CPU tensor) or the
        default group (this rank's device). What ranks agree on with it (a failure, and
        whose) costs the same bytes at any world size, where a gather would grow with it."""
        import torch.distributed as tdist

        if self.ctx.world_size <= 1 or not (tdist.is_available() and tdist.is_initialized()):
            return mine
        device = torch.device("cpu") if group is not None else self.ctx.device
        box = torch.tensor([_NOBODY if mine is None else mine], dtype=torch.int64, device=device)
        tdist.all_reduce(box, op=tdist.ReduceOp.MIN, group=group)
        value = int(box.item())
        return None if value == _NOBODY else value
