"""The save path of the :class:`~ddp.checkpoint.manager.Checkpointer`.

A plain (DDP) checkpoint: every rank's own file, rank 0's checkpoint file, finished in
the background. A sharded (FSDP2) one: every rank's shards through DCP, then rank 0's
meta file, rename and ``latest``. The final export. Every rank agrees on a failure and
raises the same line; a diverged run (weights not finite) saves nothing.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

import ddp
from ddp import checkpoint as ckpt
from ddp import fsdp
from ddp.checkpoint import sharded
from ddp.checkpoint.loop import LoopState, TrainState
from ddp.checkpoint.manager_base import CheckpointerBase
from ddp.errors import ConfigError, TrainingDiverged

log = logging.getLogger("ddp")


class Saving(CheckpointerBase):
    """Save: checkpoints (plain or sharded, in the background by default) and the export."""

    def save(self, loop: LoopState, model: torch.nn.Module, train: TrainState) -> None:
        """Collective: every rank writes its own state (its RNG streams) into its own rank
        file, and rank 0 the checkpoint file (DDP), or every rank its shards (FSDP);
        finished in the background by default.

        No rank receives another's state: what the ranks must agree on (finite weights,
        every write done) is one all-reduce of one integer each (:meth:`_first`), so the
        bytes a save moves per rank do not grow with the number of ranks.
        The counters are the state objects' own (``train``, ``loop``: a resumed run starts
        at ``loop.resume_at``)."""
        if not self.dir:
            return
        global_step = train.global_step
        if self._first(None if finite(model) else self.ctx.rank) is not None:
            raise diverged(global_step, "the weights are not finite (nan/inf)")
        own = {
            **train.state_dict(),
            "world_size": self.ctx.world_size,
            "rank_rng": ckpt.rng_state(self.ctx.device),
        }
        if self.config.ddp.strategy == "fsdp":
            self._save_sharded(loop, model, train, own)
        else:
            self._save_plain(loop, model, train, own)

    def _save_plain(
        self, loop: LoopState, model: torch.nn.Module, train: TrainState, own: dict[str, Any]
    ) -> None:
        """Collective: this rank's rank file, rank 0's checkpoint file (staged), one
        all-reduce on whether every write succeeded, then rank 0 finishes the save (in the
        background by default) or every rank raises the first failed rank's line."""
        global_step = train.global_step
        t0 = time.perf_counter()
        directory = self._directory()
        final = ckpt.step_path(directory, global_step)
        ranks = ckpt.staging_path(ckpt.rank_dir(final))
        failure: tuple[bool, str] | None = None
        error: BaseException | None = None
        staged = None
        try:
            self.wait()  # rank 0: the save before, finished; its error is every rank's
            _write_own(ranks, self.ctx.rank, own)
            if self.ctx.is_main:
                state = {
                    "model": ckpt.model_state(model),
                    "optimizer": loop.opt.state_dict(),
                    **self._common(loop, train),
                }
                staged = ckpt.stage_save(state, directory, global_step)
        except Exception as exc:  # every rank raises the first failed rank's line
            failure = (isinstance(exc, ConfigError), _first_line(exc))
            error = exc
        first = self._first(None if failure is None else self.ctx.rank)
        if first is not None:
            if self.ctx.is_main:
                if staged is not None:
                    staged.discard()
                ckpt.remove_checkpoint(ranks)  # every rank is past its write (the all-reduce)
            is_config, line = ddp.broadcast_object(failure, src=first)
            if first == self.ctx.rank and error is not None:
                raise error
            raise ConfigError(line) if is_config else RuntimeError(line)
        if self.ctx.is_main:
            assert staged is not None
            c = self.config.checkpoint
            self._pending = staged.finish(c.keep_last, self.background, ranks)
            if not self.background:
                self.wait()
            log.info(
                "saved %s in %.2fs%s",
                final,
                time.perf_counter() - t0,
                " (fsync continues in the background)" if self.background else "",
            )

    def _common(self, loop: LoopState, train: TrainState) -> dict[str, Any]:
        """What every checkpoint holds besides the model and optimizer state (each rank's
        RNG states are in its own rank file: ``rank_files``): the counters, as the state
        objects give them, the schedule, the scaler and the run's config."""
        return {
            "scheduler": loop.sched.state_dict(),
            "scaler": loop.scaler.state_dict() if loop.scaler is not None else None,
            **loop.state_dict(),
            **train.state_dict(),
            "world_size": self.ctx.world_size,
            "rank_files": True,
            "config": self.config.to_dict(),
        }

    def _save_sharded(
        self,
        loop: LoopState,
        model: torch.nn.Module,
        train: TrainState,
        own: dict[str, Any],
    ) -> None:
        """Collective: every rank's shards into the staging directory ``.step_N.tmp``, then
        its rank file (its RNG states and its shards' digests); once every rank's write is
        done, rank 0 adds the meta file, renames the directory to ``step_N`` and moves
        ``latest`` (:meth:`_finalize_sharded`).

        In the background (the default) only the copy of this rank's shards to CPU memory
        blocks the loop; the write and the finalize run in a thread, on a Gloo group of
        their own, and are finished by the next save, the export, a preemption exit or
        :meth:`close`."""
        t0 = time.perf_counter()
        directory = self._directory()
        final = ckpt.sharded_path(directory, train.global_step)
        tmp = ckpt.staging_path(final)
        self.wait()  # one save in flight at a time; its error surfaces here, on every rank
        if self.ctx.is_main:
            ckpt.remove_checkpoint(tmp)  # left by a run killed mid-save
            directory.mkdir(parents=True, exist_ok=True)
        ddp.barrier()
        meta = None
        if self.ctx.is_main:  # taken now: the loop moves on while the shards are written
            meta = copy.deepcopy({**self._common(loop, train), "format": ckpt.FORMAT_VERSION})
        if self.background:
            self._group = ddp.dist.checkpoint_group()  # collective the first time (all ranks)
            extra, written = sharded.save_async(tmp, model, loop.opt, self._group)
        else:
            extra, written = _save_now(tmp, model, loop.opt)
        if meta is not None:
            meta.update(extra)
        blocked = time.perf_counter() - t0

        def finalize() -> None:
            self._finalize_sharded(written, tmp, final, meta, own, blocked, t0)

        self._pending = ckpt.PendingSave(final, finalize, self.background)
        if not self.background:
            self.wait()

    def _finalize_sharded(
        self,
        written: Any,
        tmp: Path,
        final: Path,
        meta: dict[str, Any] | None,
        own: dict[str, Any],
        blocked: float,
        t0: float,
    ) -> None:
        """Collective (on the save's group): wait for this rank's write, write its rank file
        (with its shards' digests), agree that every rank's succeeded, then rank 0 makes
        the checkpoint visible. Every rank raises the same error (the first failed rank's,
        as one line) or none, so a failure never leaves a rank waiting in a collective the
        others skip. The agreement is an all-reduce of one integer and a broadcast of one
        line: no rank receives the others' digests or states."""
        group = self._group if self.background else None
        directory = final.parent
        rank, world = self.ctx.rank, self.ctx.world_size
        failure: tuple[bool, bool, str] | None = None
        try:
            written()  # DCP raises the same CheckpointException on every rank
            own["rank_shards"] = {
                f.name: ckpt.sha256_file(f) for f in tmp.glob(f"__{rank}_*.distcp")
            }
            ckpt.write_rank_state(tmp, rank, own)
        except BaseException as exc:  # CheckpointException is one
            failure = _describe(exc, rank, directory, tmp.name)
        # A rank's own failure first (it has the file system's words), then rank order.
        key = None if failure is None else rank + (0 if failure[0] else world)
        first = self._first(key, group)
        outcome = None
        if first is not None:
            outcome = ddp.broadcast_object(failure, src=first % world, group=group)
        else:
            if self.ctx.is_main:
                assert meta is not None
                try:
                    self._publish(tmp, final, meta)
                except BaseException as exc:  # reported on every rank
                    outcome = _describe(exc, 0, directory, final.name)
            outcome = ddp.broadcast_object(outcome, group=group)
        if outcome is not None:
            if self.ctx.is_main:
                ckpt.remove_checkpoint(tmp)  # every rank is done with it (the all-reduce)
            _, is_write_error, message = outcome
            raise ConfigError(message) if is_write_error else RuntimeError(message)
        if self.ctx.is_main:
            log.info(
                "saved %s (%d shards): training blocked %.2fs, durable after %.2fs%s",
                final,
                world,
                blocked,
                time.perf_counter() - t0,
                " (written in the background)" if self.background else "",
            )

    def _publish(self, tmp: Path, final: Path, meta: dict[str, Any]) -> None:
        """Rank 0, every shard and rank file written: the meta file with the digest of
        DCP's ``.metadata`` (each rank's file has its own shards'), the rename into place,
        ``latest``, keep-last pruning and stale staging directories."""
        directory = final.parent
        meta["shards"] = {".metadata": ckpt.sha256_file(tmp / ".metadata")}
        ckpt.atomic_save_digested(meta, tmp / ckpt.META)
        ckpt.remove_checkpoint(final)  # a checkpoint of the same step from an older run
        os.replace(tmp, final)
        ckpt.fsync_dir(directory)
        ckpt.atomic_write_text(final.name + "\n", directory / ckpt.LATEST)
        ckpt.prune(directory, self.config.checkpoint.keep_last, final)
        ckpt.remove_stale_staging(directory)

    def export(self, model: torch.nn.Module, global_step: int) -> str | None:
        """Collective: ``final/model.pt`` for single-device inference (``save_final``)."""
        c = self.config.checkpoint
        self.wait()
        if not (self.dir and c.save_final):
            return None
        if self._first(None if finite(model) else self.ctx.rank) is not None:
            raise diverged(global_step, "the weights are not finite (nan/inf)")
        full = fsdp.full_state_dict(model) if fsdp.is_sharded(model) else None  # collective
        path, error = None, None
        if self.ctx.is_main:
            try:
                path = str(ckpt.export_final(model, self.dir, self.config.to_yaml(), full))
            except OSError as exc:  # a full disk: one line on every rank, none left waiting
                error = str(ckpt.save_error(Path(self.dir), "final", exc))
        path, error = ddp.broadcast_object((path, error))
        if error:
            raise ConfigError(error)
        return path


def _write_own(directory: Path, rank: int, own: dict[str, Any]) -> None:
    """This rank's rank file into the staging directory; a write error is one line
    naming the file and the rank (:func:`ddp.checkpoint.write_error`)."""
    try:
        ckpt.write_rank_state(directory, rank, own)
    except OSError as exc:
        raise ckpt.save_error(directory.parent, directory.name, exc, rank) from None


def _first_line(exc: BaseException) -> str:
    """An error as the one line the other ranks raise for it."""
    return str(exc) if isinstance(exc, ConfigError) else sharded.first_line(exc)


def _save_now(tmp: Path, model: torch.nn.Module, opt: Any) -> tuple[dict[str, Any], Any]:
    """The synchronous write, shaped like ``sharded.save_async``'s result: its failure
    (DCP raises a CheckpointException, a BaseException) is re-raised by ``written()``,
    so both paths report it the same way, on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return sharded.save(tmp, model, opt), lambda: None
    except (Exception, CheckpointException) as exc:
        failure = exc

        def written() -> None:
            raise failure

        return {}, written


def _describe(exc: BaseException, rank: int, directory: Path, name: str) -> tuple[bool, bool, str]:
    """(about this rank's own failure, is a write error, one line) for a failed sharded save.

    DCP wraps each rank's failure in a CheckpointException (traceback text included) and
    raises it on every rank. A rank names its own failure where it has one: only there
    does the exception keep what torch wrapped (an OSError under "unexpected pos", see
    :func:`ddp.checkpoint.write_error`), since other ranks' exceptions arrive pickled;
    else the first failed rank's. The caller picks one line for all ranks. An OSError
    (full disk, quota, read-only) is a ConfigError line, as for a plain checkpoint."""
    own = True
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        own = rank in failures
        rank = rank if own else min(failures)
        first = failures[rank]
        exc = first[0] if isinstance(first, tuple) else first
    err = ckpt.write_error(exc)
    if err is not None:
        return own, True, str(ckpt.save_error(directory, name, err, rank))
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return (
        own,
        False,
        (
            f"checkpoint.dir {str(directory)!r}: writing {name} (rank {rank}) "
            f"failed: {type(exc).__name__}: {text}; the earlier checkpoints are "
            "kept"
        ),
    )


# ---- the check before every save: a diverged run saves nothing ------------------------
def finite(model: torch.nn.Module) -> bool:
    """Whether this rank's weights are all finite (one host sync: checkpoints only)."""
    params = fsdp.local_tensors(ddp.unwrap(model))
    if not params:
        return True
    return bool(torch.stack([torch.isfinite(p).all() for p in params]).all())


def diverged(step: int, what: str) -> TrainingDiverged:
    """The error that stops a diverged run: nothing is saved from its weights.

    Stopping, not skipping, follows Keras' TerminateOnNaN and Lightning's former
    ``terminate_on_nan``: a NaN rarely heals, and a skipped step hides the cause.
    """
    return TrainingDiverged(
        f"step {step}: {what}: training diverged; nothing was saved from these weights and "
        "the earlier checkpoints are kept. Lower optim.lr, set optim.grad_clip, or check "
        "the data"
    )
