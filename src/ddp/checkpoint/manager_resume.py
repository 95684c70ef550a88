"""The resume path of the :class:`~ddp.checkpoint.manager.Checkpointer`.

Finding the checkpoint to resume from (rank 0 looks, every rank reads only its own rank
file), restoring the weights, RNG streams, optimizer, schedule and scaler, the checks
that a checkpoint fits this run (:func:`check_resumable`, :func:`check_optimizer`) and
the config's new hyper-parameters applied on top (:func:`apply_new_hyperparameters`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

import ddp
from ddp import checkpoint as ckpt
from ddp.checkpoint import sharded
from ddp.checkpoint.loop import LoopState
from ddp.checkpoint.manager_base import CheckpointerBase
from ddp.config import TrainConfig
from ddp.errors import ConfigError

log = logging.getLogger("ddp")


class Resume(CheckpointerBase):
    """Resume: find, read, check and restore a checkpoint (``checkpoint.resume``)."""

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
                            found = ckpt.readable_checkpoints(self._directory(), ranks=False)
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
        check_resumable(
            state.get("config") or {},
            self.config.to_dict(),
            path,
            (state.get("world_size") or 1, self.ctx.world_size),
        )
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
        mine = (
            range(rank, saved_world, world) if sharded else ([rank] if saved_world == world else [])
        )
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
            log.info(
                "checkpoint from world size %s, running on %d: RNG streams derived from "
                "(training.seed %d, step %d, rank)",
                state.get("world_size"),
                world,
                self.config.training.seed,
                state["global_step"],
            )
        if "sharded" in state:
            sharded.load_model(Path(state["sharded"]), model, self.resumed_from)
        else:
            load_model(ddp.unwrap(model), state["model"], self.resumed_from)

    def restore_loop(
        self, state: dict[str, Any], loop: LoopState, base_lr: float, model: torch.nn.Module
    ) -> None:
        """Optimizer, schedule and scaler, then the config's new values on top, then the
        loop's position (:meth:`LoopState.load_state_dict`)."""
        path = self.resumed_from
        live_sched = loop.sched.state_dict()
        # Keys this torch does not know are dropped (load_state_dict would set them as
        # attributes); keys it misses keep this run's values (an older torch wrote it).
        sched_state = {
            **live_sched,
            **{k: v for k, v in state["scheduler"].items() if k in live_sched},
        }
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
        loop.load_state_dict(
            {
                **state,
                "samples_in_epoch": samples_in_epoch(
                    state, self.ctx.world_size, self.config.training.batch_size
                ),
            }
        )


def samples_in_epoch(state: dict[str, Any], world: int, batch_size: int) -> int:
    """The saved position in samples of the epoch's global order. A checkpoint written
    before ``samples_in_epoch`` counted micro-batches of its own world size
    (``batches_in_epoch``), each of ``batch_size`` samples per rank."""
    samples = state.get("samples_in_epoch")
    if samples is None:
        saved_world = state.get("world_size") or world
        samples = state["batches_in_epoch"] * saved_world * batch_size
    return int(samples)


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


# Keys whose change makes the saved data position or optimizer state meaningless.
_FIXED_ON_RESUME = (
    "optim.name",
    "training.batch_size",
    "training.accum",
    "training.seed",
    "training.shuffle",
    "training.drop_last",
    "ddp.strategy",
)


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
                raise ConfigError(
                    f"checkpoint {path!r} has a bad config {key}: {v!r:.60}; "
                    "allowed: an integer >= 1"
                )
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
            log.warning(
                "resume: %s changed %r -> %r; the new value applies", key, before[key], after[key]
            )


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
    ckpt.check_same_model(
        {k: tuple(v.shape) for k, v in saved.items()},
        {k: tuple(v.shape) for k, v in own.items()},
        path,
    )
    model.load_state_dict(saved)


def check_optimizer(saved: Any, opt: torch.optim.Optimizer) -> None:
    """ValueError naming the first part of a saved optimizer state that this optimizer
    cannot take: its groups (their number, sizes and hyper-parameter types) and every
    per-parameter tensor's shape (torch would load a wrong one and fail steps later)."""
    live = opt.state_dict()
    groups = saved["param_groups"]
    if len(groups) != len(live["param_groups"]):
        raise ValueError(
            f"has {len(groups)} optimizer parameter groups; allowed: "
            f"{len(live['param_groups'])}, as this optimizer has"
        )
    shapes: dict[Any, tuple[int, ...]] = {}
    for i, (group, mine) in enumerate(zip(groups, opt.param_groups, strict=True)):
        ids = group.get("params")
        if not isinstance(ids, list) or len(ids) != len(mine["params"]):
            raise ValueError(
                f"has a bad optimizer.param_groups[{i}].params: {ids!r:.60}; "
                f"allowed: {len(mine['params'])} parameter ids"
            )
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
                    raise ValueError(
                        f"has a bad {where}.{name}: shape {tuple(value.shape)}; "
                        f"allowed: {shapes[key]}, the parameter's"
                    )
            elif value is not None:
                ckpt.check_like(
                    value, 0.0 if not isinstance(value, bool) else False, f"{where}.{name}"
                )
