"""The Checkpointer: one object that owns a run's checkpoints.

It owns the state keys (the trainer never builds a checkpoint dict), the directory lock,
the background save and its errors, keep-last pruning, the resume lookup, restoring
every piece of state, the checks that a checkpoint fits this run, and the final export.
The file format itself (atomic writes, digests, ``latest``) is :mod:`ddp.checkpoint`.
Modelled on torchtitan's ``CheckpointManager``; every method that touches other ranks
says so.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ddp
from ddp import checkpoint as ckpt
from ddp import fsdp
from ddp.checkpoint import sharded
from ddp.config import TrainConfig
from ddp.dist import Context
from ddp.errors import ConfigError, TrainingDiverged

log = logging.getLogger("ddp")


@dataclass
class LoopState:
    """Where the loop is and what it trains with: what a checkpoint captures."""

    phase: int
    epoch: int
    batch: int  # micro-batches done in this epoch
    n_batches: int  # micro-batches per epoch on this rank
    phase_start: int  # global step at which this phase began
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any  # torch.amp.GradScaler for fp16, else None
    per_batch: int = 1  # samples one micro-batch of the whole job takes (batch x world)
    base: int = 0  # samples of the epoch consumed before micro-batch 0 of this run's count

    def samples_done(self, at: tuple[int, int] | None = None) -> int:
        """Samples consumed in the epoch's global order (all ranks together) at micro-batch
        ``at`` = (epoch, batch), default now: the position a checkpoint records."""
        epoch, batch = at if at is not None else (self.epoch, self.batch)
        return (self.base if epoch == self.epoch else 0) + batch * self.per_batch

    def seek(self, samples: int, accum: int) -> None:
        """Continue at ``samples`` into the epoch, on this run's world size: whole
        optimizer steps of this world size as micro-batches, the rest as ``base``."""
        self.batch = samples // (self.per_batch * accum) * accum
        self.base = samples - self.batch * self.per_batch

    def after_batches(self) -> tuple[int, int]:
        """The position after the batches done so far: a finished epoch is the next
        one's start (an evaluation still owed is saved as (epoch, n_batches) instead)."""
        if self.batch >= self.n_batches:
            return self.epoch + 1, 0
        return self.epoch, self.batch


class Checkpointer:
    """Saves and restores one run's state in ``config.checkpoint.dir`` (None: off)."""

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
        self._best: float | None = None  # checkpoint.best's value so far (keep_best)
        self._best_read = False

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

    # ---- resume -------------------------------------------------------------------------
    def load(self) -> dict[str, Any] | None:
        """Collective: the checkpoint to resume from (``checkpoint.resume``), or None.

        Rank 0 finds and checks it (every shard's digest, for a sharded one of the old
        layout; its meta file and ``.metadata`` otherwise); every rank then reads it, or
        only its meta file, and its own rank file (:meth:`_read_own`): no rank reads
        another's state. A rank file missing or damaged on any rank is every rank's
        line (``checkpoint.resume: PATH``), or, under ``auto``, a step back to the next
        older checkpoint, as for a damaged checkpoint file. The agreement is one
        all-reduce of one integer per checkpoint tried."""
        c = self.config.checkpoint
        if c.resume == "none" or (c.resume == "auto" and not self.dir):
            return None
        auto = c.resume == "auto"
        found = None  # rank 0: the checkpoints of the directory, newest first
        while True:
            path, error = None, None
            if self.ctx.is_main:
                try:
                    if auto:
                        if found is None:
                            found = ckpt.readable_checkpoints(self.dir, ranks=False)  # type: ignore[arg-type]
                        nxt = next(found, None)
                        path = str(nxt[0]) if nxt else None
                    else:
                        ckpt.load_checkpoint(c.resume, ranks=False)
                        path = c.resume
                except ConfigError as exc:
                    error = str(exc)
            path, error = ddp.broadcast_object((path, error))
            if error:
                raise ConfigError(error)
            if path is None:
                return None
            state = ckpt.load_checkpoint(path, verify_shards=False)
            try:
                ckpt.check_fields(state, required=ckpt.TRAINER_FIELDS)
            except ValueError as exc:  # the same file on every rank: the same line on each
                raise ConfigError(f"checkpoint {path!r} {exc}") from None
            problem = self._read_own(state, path)
            first = self._first(None if problem is None else self.ctx.rank)
            if first is None:
                break
            line = ddp.broadcast_object(problem, src=first)
            if not auto:
                raise ConfigError(f"checkpoint.resume: {path!r} {line}")
            if self.ctx.is_main:
                log.warning("checkpoint %s %s; trying an older one", path, line)
        log.info("resuming from %s (step %d)", path, state["global_step"])
        self.resumed_from = path
        check_resumable(state.get("config") or {}, self.config.to_dict(), path,
                        (state.get("world_size") or 1, self.ctx.world_size))  # fmt: skip
        return state

    def _read_own(self, state: dict[str, Any], path: str) -> str | None:
        """Put this rank's own RNG states into ``state["rank_rng"]`` (None where this world
        size differs from the checkpoint's: derived then); what is wrong, or None.

        Reads this rank's file only, at the same world size. A sharded checkpoint also
        has the shards of the saved ranks this rank stands for (``rank``, ``rank +
        world``, ...) checked against the digests their files list: every shard is
        checked once, by one rank, and no rank checks more than its share. A checkpoint
        of the earlier layout holds every rank's states in one list (``rng``): this rank's
        is taken from it."""
        rank, world = self.ctx.rank, self.ctx.world_size
        saved_world = state.get("world_size") or 1
        gathered = state.pop("rng", None) or []
        state["rank_rng"] = None
        if not state.get("rank_files"):
            if saved_world == world and len(gathered) == world:
                state["rank_rng"] = gathered[rank]
            return None
        sharded = "sharded" in state
        mine = range(rank, saved_world, world) if sharded else (
            [rank] if saved_world == world else [])  # fmt: skip
        try:
            for saved_rank in mine:
                own = ckpt.read_rank_state(path, saved_rank, state)
                if sharded:
                    ckpt.check_shards(Path(path), own.get("rank_shards") or {})
                if saved_world == world:
                    state["rank_rng"] = own["rank_rng"]
        except ValueError as exc:
            return str(exc)
        return None

    def restore_model(self, state: dict[str, Any], model: torch.nn.Module) -> None:
        """Collective for sharded checkpoints: this rank's RNG streams (same world size
        only, from :meth:`load`) and the weights (resharded to this world size)."""
        world = self.ctx.world_size
        if state.get("rank_rng") is not None:
            ckpt.set_rng_state(state["rank_rng"], self.ctx.device)
        else:
            derive_rng(self.config.training.seed, state["global_step"], self.ctx.rank)
            log.info("checkpoint from world size %s, running on %d: RNG streams derived from "
                     "(training.seed %d, step %d, rank)", state.get("world_size"), world,
                     self.config.training.seed, state["global_step"])  # fmt: skip
        if "sharded" in state:
            sharded.load_model(Path(state["sharded"]), model, self.resumed_from)
        else:
            load_model(ddp.unwrap(model), state["model"], self.resumed_from)

    def restore_loop(
        self, state: dict[str, Any], loop: LoopState, base_lr: float, model: torch.nn.Module
    ) -> None:
        """Optimizer, schedule and scaler, then the config's new values on top."""
        path = self.resumed_from
        live_sched = loop.sched.state_dict()
        # Keys this torch does not know are dropped (load_state_dict would set them as
        # attributes); keys it misses keep this run's values (an older torch wrote it).
        sched_state = {**live_sched,
                       **{k: v for k, v in state["scheduler"].items() if k in live_sched}}  # fmt: skip
        scaler = state.get("scaler") if loop.scaler is not None else None
        try:
            ckpt.check_like(sched_state, live_sched, "scheduler")
            if scaler:
                ckpt.check_like(scaler, loop.scaler.state_dict(), "scaler")
            if "sharded" not in state:
                check_optimizer(state.get("optimizer"), loop.opt)
        except ValueError as exc:
            raise ConfigError(f"checkpoint {path!r} {exc}") from None
        if "sharded" in state:
            sharded.load_optimizer(Path(state["sharded"]), model, loop.opt, state, path)
        else:
            loop.opt.load_state_dict(state["optimizer"])
        loop.sched.load_state_dict(sched_state)
        apply_new_hyperparameters(loop.opt, loop.sched, base_lr, self.config)
        if scaler:
            loop.scaler.load_state_dict(scaler)
        loop.epoch = state["epoch"]
        samples = state.get("samples_in_epoch")
        if samples is None:  # written before samples_in_epoch: micro-batches of its world
            world = state.get("world_size") or self.ctx.world_size
            samples = state["batches_in_epoch"] * world * self.config.training.batch_size
        loop.seek(samples, self.config.training.accum)

    # ---- save ---------------------------------------------------------------------------
    def save(
        self, loop: LoopState, model: torch.nn.Module, global_step: int, at: tuple[int, int]
    ) -> None:
        """Collective: every rank writes its own state (its RNG streams) into its own rank
        file, and rank 0 the checkpoint file (DDP), or every rank its shards (FSDP);
        finished in the background by default.

        No rank receives another's state: what the ranks must agree on (finite weights,
        every write done) is one all-reduce of one integer each (:meth:`_first`), so the
        bytes a save moves per rank do not grow with the number of ranks.
        ``at`` is the (epoch, micro-batch) a resumed run starts from."""
        if not self.dir:
            return
        if self._first(None if finite(model) else self.ctx.rank) is not None:
            raise diverged(global_step, "the weights are not finite (nan/inf)")
        own = {"global_step": global_step, "world_size": self.ctx.world_size,
               "rank_rng": ckpt.rng_state(self.ctx.device)}  # fmt: skip
        if self.config.ddp.strategy == "fsdp":
            self._save_sharded(loop, model, global_step, at, own)
            return
        t0 = time.perf_counter()
        directory = Path(self.dir)
        final = ckpt.step_path(directory, global_step)
        ranks = ckpt.staging_path(ckpt.rank_dir(final))
        failure: tuple[bool, str] | None = None
        error: BaseException | None = None
        staged = None
        try:
            self.wait()  # rank 0: the save before, finished; its error is every rank's
            _write_own(ranks, self.ctx.rank, own)
            if self.ctx.is_main:
                state = {"model": ckpt.model_state(model), "optimizer": loop.opt.state_dict(),
                         **self._common(loop, global_step, at)}  # fmt: skip
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
            log.info("saved %s in %.2fs%s", final, time.perf_counter() - t0,
                     " (fsync continues in the background)" if self.background else "")  # fmt: skip

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

    def _common(self, loop: LoopState, global_step: int, at: tuple[int, int]) -> dict[str, Any]:
        """What every checkpoint holds besides the model and optimizer state (each rank's
        RNG states are in its own rank file: ``rank_files``)."""
        epoch, batch = at
        return {
            "scheduler": loop.sched.state_dict(),
            "scaler": loop.scaler.state_dict() if loop.scaler is not None else None,
            "phase": loop.phase,
            "epoch": epoch,
            "batches_in_epoch": batch,
            "samples_in_epoch": loop.samples_done(at),  # any world size resumes here
            "global_step": global_step,
            "phase_start_step": loop.phase_start,
            "world_size": self.ctx.world_size,
            "rank_files": True,
            "config": self.config.to_dict(),
        }

    def _save_sharded(self, loop: LoopState, model: torch.nn.Module, global_step: int,
                      at: tuple[int, int], own: dict[str, Any]) -> None:  # fmt: skip
        """Collective: every rank's shards into the staging directory ``.step_N.tmp``, then
        its rank file (its RNG states and its shards' digests); once every rank's write is
        done, rank 0 adds the meta file, renames the directory to ``step_N`` and moves
        ``latest`` (:meth:`_finalize_sharded`).

        In the background (the default) only the copy of this rank's shards to CPU memory
        blocks the loop; the write and the finalize run in a thread, on a Gloo group of
        their own, and are finished by the next save, the export, a preemption exit or
        :meth:`close`."""
        t0 = time.perf_counter()
        directory = Path(self.dir)  # type: ignore[arg-type]
        final = ckpt.sharded_path(directory, global_step)
        tmp = ckpt.staging_path(final)
        self.wait()  # one save in flight at a time; its error surfaces here, on every rank
        if self.ctx.is_main:
            ckpt.remove_checkpoint(tmp)  # left by a run killed mid-save
            directory.mkdir(parents=True, exist_ok=True)
        ddp.barrier()
        meta = None
        if self.ctx.is_main:  # taken now: the loop moves on while the shards are written
            meta = copy.deepcopy({**self._common(loop, global_step, at),
                                  "format": ckpt.FORMAT_VERSION})  # fmt: skip
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

    def _finalize_sharded(self, written: Any, tmp: Path, final: Path, meta: dict[str, Any] | None,
                          own: dict[str, Any], blocked: float, t0: float) -> None:  # fmt: skip
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
            own["rank_shards"] = {f.name: ckpt.sha256_file(f)
                                  for f in tmp.glob(f"__{rank}_*.distcp")}  # fmt: skip
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
            log.info("saved %s (%d shards): training blocked %.2fs, durable after %.2fs%s",
                     final, world, blocked, time.perf_counter() - t0,
                     " (written in the background)" if self.background else "")  # fmt: skip

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


    # ---- best model (issue 27.3; seed 002's best_model.pt) ----------------------------
    BEST = "best"
    BEST_ALIAS = "best_model.pt"
    BEST_META = "best.json"

    def keep_best(self, model: torch.nn.Module, metrics: dict[str, float],
                  global_step: int) -> str | None:  # fmt: skip
        """Collective at an evaluation: ``best/model.pt`` when ``checkpoint.best``'s
        metric improved; returns its path, or None when nothing was written.

        The decision needs no message between ranks: ``metrics`` come from the
        evaluation's one all-reduce, so every rank holds the same numbers and takes the
        same decision (the write, and the sharded model's gather, are then collectives
        every rank joins). Rank 0 writes ``best/model.pt`` and ``best/config.yaml`` in
        ``final/``'s format (atomic, like :func:`ddp.checkpoint.export_final`), then
        ``best/best.json`` (metric, value, step), which a resumed run reads back so a
        worse evaluation after a restart never replaces the best; the seed's
        ``best_model.pt`` is a link to ``best/model.pt``. Only an improvement costs a
        message: the write's error (a full disk) is broadcast so every rank stops with
        the same line, as the seed's barrier after ``save_checkpoint('best_model.pt')``.
        """
        b = self.config.checkpoint.best
        if not (self.dir and b.metric) or not metrics:
            return None
        key = best_key(b.metric)
        if key not in metrics:
            known = ", ".join("eval/" + k[len("eval_"):] for k in sorted(metrics))
            raise ConfigError(f"checkpoint.best.metric: {b.metric!r} is not a metric this "
                              f"run evaluates; allowed: {known}")  # fmt: skip
        if not self._best_read:  # once per run: what a resumed run had kept
            self._best = self._read_best(key) if self.resumed_from else None
            self._best_read = True
        value = float(metrics[key])
        if not math.isfinite(value):
            return None
        if self._best is not None and not (value < self._best if b.mode == "min"
                                           else value > self._best):  # fmt: skip
            return None
        self._best = value
        full = fsdp.full_state_dict(model) if fsdp.is_sharded(model) else None  # collective
        path, error = None, None
        if self.ctx.is_main:
            try:
                path = str(self._write_best(model, full, key, value, global_step))
            except OSError as exc:
                error = str(ckpt.save_error(Path(self.dir), self.BEST, exc))
            else:
                log.info("best model: %s=%.6g at step %d -> %s", key, value, global_step,
                         path)  # fmt: skip
        path, error = ddp.broadcast_object((path, error))
        if error:
            raise ConfigError(error)
        return path

    def _write_best(self, model: torch.nn.Module, full: dict[str, torch.Tensor] | None,
                    key: str, value: float, step: int) -> Path:  # fmt: skip
        best = Path(self.dir) / self.BEST  # type: ignore[arg-type]
        source = ckpt.model_state(model) if full is None else full
        state = {k: v.detach().to("cpu").clone() for k, v in source.items()}
        path = best / "model.pt"
        ckpt.atomic_save(state, path)
        ckpt.atomic_write_text(self.config.to_yaml(), best / "config.yaml")
        meta = {"metric": key, "mode": self.config.checkpoint.best.mode, "value": value,
                "step": step}  # fmt: skip
        ckpt.atomic_write_text(json.dumps(meta) + "\n", best / self.BEST_META)
        alias = Path(self.dir) / self.BEST_ALIAS  # type: ignore[arg-type]
        if not alias.is_symlink():  # a link stays right: it names best/model.pt
            try:  # relative, so the checkpoint folder may move
                if alias.exists():
                    raise OSError("a copy from an earlier write")
                alias.symlink_to(Path(self.BEST) / "model.pt")
            except OSError:  # no symlinks here (Windows without the privilege): a copy
                ckpt.atomic_save(state, alias)
        return path

    def _read_best(self, key: str) -> float | None:
        """Rank 0 reads ``best/best.json`` (untrusted: small regular file, JSON checked);
        every rank gets its value. A file for another metric or mode is not comparable:
        None (the next evaluation becomes the best)."""
        value = None
        if self.ctx.is_main:
            path = Path(self.dir) / self.BEST / self.BEST_META  # type: ignore[arg-type]
            try:
                meta = json.loads(ckpt.read_regular(path))
                if (isinstance(meta, dict) and meta.get("metric") == key
                        and meta.get("mode") == self.config.checkpoint.best.mode
                        and isinstance(meta.get("value"), int | float)
                        and math.isfinite(meta["value"])):  # fmt: skip
                    value = float(meta["value"])
            except (ValueError, OSError):  # absent or damaged: start afresh
                value = None
        return ddp.broadcast_object(value)


def best_key(metric: str) -> str:
    """``eval/loss`` (the seeds' W&B spelling) or ``eval_loss`` -> ``eval_loss``, the
    key :meth:`ddp.trainer.Trainer.evaluate` returns."""
    name = metric.removeprefix("eval/").removeprefix("eval_")
    return f"eval_{name}"


_NOBODY = 1 << 62
"""What :meth:`Checkpointer._first` reads as "no rank reported anything"."""


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


def _describe(exc: BaseException, rank: int, directory: Path, name: str
              ) -> tuple[bool, bool, str]:  # fmt: skip
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
    return own, False, (f"checkpoint.dir {str(directory)!r}: writing {name} (rank {rank}) "
                        f"failed: {type(exc).__name__}: {text}; the earlier checkpoints are "
                        "kept")  # fmt: skip


def derive_rng(seed: int, step: int, rank: int) -> None:
    """Seed python, numpy and torch (every device) from (seed, step, rank): the streams of
    a run resumed on another world size, where saved per-rank states do not map."""
    import hashlib
    import random

    import numpy as np

    digest = hashlib.blake2b(f"ddp-rng/{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little") >> 1
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


# ---- checks on weights and on a checkpoint ------------------------------------------------
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


# Keys whose change makes the saved data position or optimizer state meaningless.
_FIXED_ON_RESUME = ("optim.name", "training.batch_size", "training.accum", "training.seed",
                    "training.shuffle", "training.drop_last", "ddp.strategy")  # fmt: skip


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resumable(
    old: dict[str, Any], new: dict[str, Any], path: str, worlds: tuple[int, int] = (1, 1)
) -> None:
    """Stop on a change the checkpoint cannot carry; log every other changed key.

    A resumed run either applies a new value (optimizer hyper-parameters, the schedule,
    more epochs: :func:`apply_new_hyperparameters`) and says so, or stops with one
    line; it never mixes old and new silently. ``batch_size`` and ``accum`` may change
    with the number of ranks (``worlds``: the checkpoint's, this run's) as long as
    batch_size x accum x ranks stays the same: every optimizer step then takes the same
    samples of the epoch's global order, so the run continues as if uninterrupted, up
    to floating-point round-off (a PBS job's next submission often gets other nodes).
    """
    before, after = _flat(old), _flat(new)
    changed = [k for k in after if k in before and before[k] != after[k]]

    def per_step(cfg: dict[str, Any], world: int) -> int:
        out = world
        for key in ("training.batch_size", "training.accum"):
            v = cfg.get(key, 1)
            if type(v) is not int or v < 1:  # a crafted or damaged checkpoint's config
                raise ConfigError(f"checkpoint {path!r} has a bad config {key}: {v!r:.60}; "
                                  "allowed: an integer >= 1")  # fmt: skip
            out *= v
        return out

    same_step = per_step(before, worlds[0]) == per_step(after, worlds[1])
    for key in changed:
        if key in ("training.batch_size", "training.accum") and same_step:
            continue
        if key in ("training.batch_size", "training.accum"):
            raise ConfigError(
                f"{key}: {after[key]!r} differs from {before[key]!r} in the checkpoint "
                f"{path!r}; allowed: batch_size x accum x ranks equal to the checkpoint's "
                f"{per_step(before, worlds[0])} (now {per_step(after, worlds[1])} on "
                f"{worlds[1]} ranks), or a fresh checkpoint.dir / checkpoint.resume=none"
            )
        if key in _FIXED_ON_RESUME:
            raise ConfigError(
                f"{key}: {after[key]!r} differs from {before[key]!r} in the checkpoint "
                f"{path!r}, which cannot continue with it; allowed: the checkpoint's value, "
                "or a fresh checkpoint.dir / checkpoint.resume=none"
            )
    for key in changed:
        if key != "checkpoint.resume":
            log.warning("resume: %s changed %r -> %r; the new value applies", key,
                        before[key], after[key])  # fmt: skip


def apply_new_hyperparameters(opt: Any, sched: Any, base_lr: float, cfg: TrainConfig) -> None:
    """Make the config's optimizer values win over the ones restored from the checkpoint.

    ``opt.load_state_dict`` brings back the saved lr, weight decay and betas, and the
    scheduler its saved base LR; without this a new ``optim.lr`` would be printed at
    start-up and then ignored. Unchanged values are left untouched (bit-exact resume).
    """
    o = cfg.optim
    want: dict[str, Any] = {"weight_decay": o.weight_decay}
    if o.name == "sgd":
        want["momentum"] = o.momentum
    else:
        want["betas"] = (o.betas[0], o.betas[1])
    for group in opt.param_groups:
        for key, value in want.items():
            if key in group and group[key] != value:
                group[key] = value
    if any(b != base_lr for b in sched.base_lrs):
        sched.base_lrs = [base_lr for _ in sched.base_lrs]
        factor = sched.lr_lambdas[0](sched.last_epoch)
        for group in opt.param_groups:
            group["initial_lr"] = base_lr
            group["lr"] = base_lr * factor
        sched._last_lr = [g["lr"] for g in opt.param_groups]


def load_model(model: torch.nn.Module, saved: dict[str, Any], path: str) -> None:
    """``load_state_dict`` with one line naming the first mismatch, not torch's 40."""
    own = model.state_dict()
    ckpt.check_same_model({k: tuple(v.shape) for k, v in saved.items()},
                          {k: tuple(v.shape) for k, v in own.items()}, path)  # fmt: skip
    model.load_state_dict(saved)


def check_optimizer(saved: Any, opt: torch.optim.Optimizer) -> None:
    """ValueError naming the first part of a saved optimizer state that this optimizer
    cannot take: its groups (their number, sizes and hyper-parameter types) and every
    per-parameter tensor's shape (torch would load a wrong one and fail steps later)."""
    live = opt.state_dict()
    groups = saved["param_groups"]
    if len(groups) != len(live["param_groups"]):
        raise ValueError(f"has {len(groups)} optimizer parameter groups; allowed: "
                         f"{len(live['param_groups'])}, as this optimizer has")  # fmt: skip
    shapes: dict[Any, tuple[int, ...]] = {}
    for i, (group, mine) in enumerate(zip(groups, opt.param_groups, strict=True)):
        ids = group.get("params")
        if not isinstance(ids, list) or len(ids) != len(mine["params"]):
            raise ValueError(f"has a bad optimizer.param_groups[{i}].params: {ids!r:.60}; "
                             f"allowed: {len(mine['params'])} parameter ids")  # fmt: skip
        shapes.update({k: tuple(p.shape) for k, p in zip(ids, mine["params"], strict=True)})
        rest = {k: v for k, v in group.items() if k != "params"}
        ckpt.check_like(rest, live["param_groups"][i], f"optimizer.param_groups[{i}]")
    for key, values in saved["state"].items():
        where = f"optimizer.state[{key!r}]"
        if key not in shapes or not isinstance(values, dict):
            raise ValueError(f"has a bad {where}: not a parameter of its groups")
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                if value.dim() and tuple(value.shape) != shapes[key]:
                    raise ValueError(f"has a bad {where}.{name}: shape {tuple(value.shape)}; "
                                     f"allowed: {shapes[key]}, the parameter's")  # fmt: skip
            elif value is not None:
                ckpt.check_like(value, 0.0 if not isinstance(value, bool) else False,
                                f"{where}.{name}")  # fmt: skip
