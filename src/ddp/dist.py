"""Process-group setup and the few collective helpers every training script needs.

``init()`` is the one call a script makes: it detects the launcher (ddp.env),
picks device and backend (ddp.backends), creates the process group with a real
``init_process_group(timeout=...)`` (PyTorch never reads ``NCCL_TIMEOUT``; the
timeout argument bounds a hung collective, and ``NCCL_TIMEOUT`` in seconds, the
seeds' advice, is read here when nothing else sets it), and logs the lines users know
from the guides. With world size 1 no process group is created and every helper
here is a cheap no-op, so the same script runs on a laptop.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddp import backends, heartbeat
from ddp._pipes import OutputHandler
from ddp.dist_teardown import _gloo_busy, _quiesce  # noqa: F401  (re-exported)
from ddp.env import DistEnv, detect
from ddp.errors import ConfigError

# Re-exported: callers, tests and docs name them ``ddp.dist.X``, and ``_init`` looks
# ``resolve_master``/``rendezvous_store`` up here (tests and bench replace them here).
from ddp.group_rules import (  # noqa: F401
    BIND_DEVICE_ID,
    XCCL_P2P_FIX,
    _lazy_gloo,
    _unbound_default_group,
    bound_device,
    xccl_p2p_env,
)
from ddp.rendezvous import (  # noqa: F401
    DEFAULT_TIMEOUT_S,
    PROBE_CAP_S,
    PROBE_FIRST_S,
    STORE_ANSWER_PER_RANK_S,
    STORE_ANSWER_S,
    _timeout,
    _timeout_and_source,
    check_resolves,
    handshake_budget,
    probe_delays,
    rendezvous_store,
    resolve_master,
)

if TYPE_CHECKING:
    import torch

    from ddp.agree import Agreement, GroupAgreement

log = logging.getLogger("ddp")


@dataclass(frozen=True)
class Context:
    """This rank's place in the job plus the device and backend it uses."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int | None  # None: the launcher does not say (see ddp.env)
    node_rank: int | None
    device: torch.device
    backend: str
    launcher: str
    master_addr: str
    master_port: int
    timeout_s: float = DEFAULT_TIMEOUT_S  # what bounds every collective (see _timeout)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group exists (world size > 1)."""
        return self.world_size > 1


_CONTEXT: Context | None = None
_AGREE: Agreement | None = None  # the ranks' tree for one-flag agreements (ddp.agree)
_CKPT_GROUP: Any = None  # a Gloo group for checkpoint collectives in a background thread


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    """Rank 0 logs INFO to stdout; other ranks only warnings, prefixed with their rank.

    Leaves the ``ddp`` logger alone when the application configured it already.
    """
    if log.handlers:
        return
    handler = OutputHandler(sys.stdout)  # quiet once stdout's reader left (ddp._pipes)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.addHandler(handler)
    log.setLevel(level if rank == 0 else logging.WARNING)
    log.propagate = False


def _set_device(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "xpu":
        torch.xpu.set_device(device)


def init(
    backend: str = "auto",
    device: str = "auto",
    timeout: float | timedelta | None = None,
    env: DistEnv | None = None,
    exit_on_error: bool = True,
) -> Context:
    """Join the job: detect the launcher, pick device and backend, create the process group.

    Idempotent: a second call returns the first context. ``timeout`` (seconds or
    timedelta; default ``$DDP_TIMEOUT`` or 1800 s) bounds every collective.

    A wrong launcher environment or an unavailable device/backend is the user's to
    fix, not a bug: by default it ends the process with one ``ddp: error: ...`` line
    on stderr and exit code 2 instead of a traceback. ``exit_on_error=False`` raises
    :class:`ConfigError` instead, for callers that want to handle it.
    """
    if _CONTEXT is not None:
        return _CONTEXT
    try:
        return _init(backend, device, timeout, env)
    except ConfigError as exc:
        if not exit_on_error:
            raise
        print(f"ddp: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _init(
    backend: str, device: str, timeout: float | timedelta | None, env: DistEnv | None
) -> Context:
    """:func:`init`'s work, one step after another in the order torch needs them (logs,
    timeout, device, site fixes, store, group, agreement tree); left whole past 60 lines
    because each step's comment says why it comes where it does."""
    global _CONTEXT
    import torch.distributed as tdist

    info = env or detect()
    if os.environ.get("DDP_RANK_LOGS") == "1":  # per_rank_logs: RUN/ranks/rank-NNNNN.log
        from ddp import rank_logs

        rank_logs.redirect(info.rank, info.world_size)
    setup_logging(info.rank)
    heartbeat.install_stack_dump(info.rank)  # issue 30: stacks on demand for ddp.supervise
    # checked on every world size, so a bad DDP_TIMEOUT never waits
    limit, limit_source = _timeout_and_source(timeout)
    choice = backends.choose(device, backend, info.local_rank, info.world_size)
    _set_device(choice.device)
    import torch

    fix = xccl_p2p_env(choice.device.type, torch.__version__, os.environ)
    if fix:  # before init_process_group: oneCCL reads them when the communicator is made
        os.environ.update(fix)
        if info.rank == 0:
            log.info(
                "torch %s on xpu: %s (pytorch#156782, fixed in 2.9)",
                torch.__version__,
                " ".join(f"{k}={v}" for k, v in fix.items()),
            )
    if info.world_size > 1 and not tdist.is_initialized():
        atexit.register(_at_exit)
        info, address = resolve_master(info)
        os.environ.update(info.torchrun_vars())  # for libraries that read env:// themselves
        store = rendezvous_store(info, limit, address)
        bound = bound_device(choice.device, choice.backend)  # after _set_device (ezpz #149)
        device_id: dict[str, Any] = {"device_id": bound} if bound is not None else {}
        tdist.init_process_group(
            backend=choice.backend,
            # The prefix torch's own init_method path adds: keys never meet an agent's.
            store=tdist.PrefixStore("default_pg", store),
            rank=info.rank,
            world_size=info.world_size,
            timeout=limit,
            **device_id,
        )
        # Small control messages (the preemption vote) travel apart from the training
        # collectives: on the device a read makes the host wait for the GPU every step,
        # and on the default Gloo group they queue behind DDP's gradient buckets
        # (measured: 0.88x the loop's speed with the vote on the default group, 1.0x
        # apart). A tree of small Gloo groups, not one group of every rank: see ddp.agree.
        from ddp import agree

        global _AGREE
        _AGREE = agree.build(store, info.rank, info.world_size, info.local_world_size, limit)
    _CONTEXT = Context(
        info.rank,
        info.local_rank,
        info.world_size,
        info.local_world_size,
        info.node_rank,
        choice.device,
        choice.backend,
        info.launcher,
        info.master_addr,
        info.master_port,
        limit.total_seconds(),
    )
    log.info(
        "Initialized DDP: rank=%d, world_size=%d, local_rank=%d",
        info.rank,
        info.world_size,
        info.local_rank,
    )
    log.info("Using device: %s", choice.device)
    log.info("collective timeout: %g s (%s)", limit.total_seconds(), limit_source)
    for note in info.notes if info.rank == 0 else ():  # the same on every rank: say it once
        log.warning("%s", note)
    log.debug(
        "launcher=%s backend=%s master=%s:%d",
        info.launcher,
        choice.backend,
        info.master_addr,
        info.master_port,
    )
    return _CONTEXT


def get_context() -> Context | None:
    return _CONTEXT


def _distributed() -> bool:
    import torch.distributed as tdist

    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def get_rank() -> int:
    if _CONTEXT is not None:
        return _CONTEXT.rank
    return detect().rank


def get_world_size() -> int:
    if _CONTEXT is not None:
        return _CONTEXT.world_size
    return detect().world_size


def is_main_process() -> bool:
    """True on global rank 0 (also before init(), from the launcher's variables)."""
    return get_rank() == 0


def barrier() -> None:
    if not _distributed():
        return
    import torch.distributed as tdist

    if _CONTEXT is not None and _CONTEXT.backend == "nccl":
        tdist.barrier(device_ids=[_CONTEXT.device.index or 0])
    else:
        tdist.barrier()


def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all ranks (a new tensor; the input is untouched)."""
    out = tensor.detach().clone()
    if _distributed():
        import torch.distributed as tdist

        tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
    return out


def reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of ``tensor`` over all ranks (Gloo has no AVG, so sum then divide)."""
    out = reduce_sum(tensor)
    world = get_world_size() if _distributed() else 1
    return out / world if out.is_floating_point() or out.is_complex() else out // world


def agreement() -> Agreement | GroupAgreement | None:
    """How the ranks agree on one flag (the preemption vote, lockstep evaluation): the
    tree :func:`init` built (:mod:`ddp.agree`); the default group when a script made
    the process group itself; None when not distributed."""
    if _AGREE is not None:
        return _AGREE
    if not _distributed():
        return None
    from ddp.agree import GroupAgreement

    return GroupAgreement()


def any_rank(flag: bool) -> bool:
    """Collective, blocking: True when ``flag`` is set on any rank (CPU only, no device
    wait; O(log W) messages over :func:`init`'s tree)."""
    way = agreement()
    return flag if way is None else bool(way.agree(flag))


def checkpoint_group() -> Any:
    """Collective on the first call (every rank, at the same point): the Gloo group that
    asynchronous checkpoint saves use (DCP's ``async_save`` and the finalize after it).

    Those collectives run in a background thread while the main thread trains on the
    default group; two threads issuing collectives on one group could pair one thread's
    collective with the other's on a peer. None when not distributed; forgotten by
    :func:`shutdown`.

    DCP needs a group of every rank, but not a full mesh: made only when a background
    save first needs it, and connected lazily (``TORCH_GLOO_LAZY_INIT``, torch >= 2.8;
    an older torch connects every pair as before), so making it costs each rank one
    listening socket and rank 0's store one address per rank; a pair connects when a
    collective first sends over it (DCP's plan gather and scatter: rank 0 to every rank;
    the rings and trees of the others: a few peers each).
    """
    global _CKPT_GROUP
    if _CKPT_GROUP is None and _distributed():
        import torch.distributed as tdist

        limit = _CONTEXT.timeout_s if _CONTEXT is not None else None
        with _lazy_gloo(), _unbound_default_group():
            _CKPT_GROUP = tdist.new_group(backend="gloo", timeout=_timeout(limit))
    return _CKPT_GROUP


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` for world size 1); ``group``: one
    spanning every rank (default: the default group)."""
    if not _distributed():
        return [obj]
    import torch.distributed as tdist

    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` as rank ``src`` has it, on every rank (``group``: one spanning every rank)."""
    if not _distributed():
        return obj
    import torch.distributed as tdist

    box = [obj]
    tdist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def wrap(model: torch.nn.Module, strategy: str = "ddp", **options: Any) -> torch.nn.Module:
    """Move ``model`` to this rank's device; when the world is larger than 1, wrap it in
    DDP (``strategy="ddp"``, ``options`` go to DistributedDataParallel) or shard it with
    FSDP2 (``strategy="fsdp"``, ``options`` go to :func:`ddp.fsdp.shard`: blocks,
    reshard_after_forward, mixed_precision, cpu_offload, activation_checkpointing)."""
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(f"strategy: {strategy!r} is not a strategy; allowed: ddp, fsdp")
    ctx = _CONTEXT or init()
    model = model.to(ctx.device)
    if not _distributed():
        return model
    if strategy == "fsdp":
        from ddp.fsdp import shard

        return shard(model, ctx.device, ctx.world_size, **options)
    from torch.nn.parallel import DistributedDataParallel

    ddp_options = options

    if ctx.device.type in ("cuda", "xpu"):
        ddp_options.setdefault("device_ids", [ctx.device.index or 0])
    return DistributedDataParallel(model, **ddp_options)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside DDP and ``torch.compile`` wrappers (keys without ``module.``)."""
    while True:
        inner = getattr(model, "module", None)
        if inner is None:
            inner = getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only."""
    if (_CONTEXT.rank if _CONTEXT is not None else get_rank()) == 0:
        print(*args, **kwargs)


def shutdown() -> None:
    """Destroy the process group (if any) and forget the context; safe to call twice."""
    global _CONTEXT, _AGREE, _CKPT_GROUP
    import torch.distributed as tdist

    _close_agreement()
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()  # every group, the checkpoint one included
    _quiesce()
    _CONTEXT = None
    _AGREE = None
    _CKPT_GROUP = None


def _close_agreement() -> None:
    """Stop the agreement's thread (rounds already started finish first)."""
    if _AGREE is not None:
        _AGREE.close()


def _at_exit() -> None:
    """Registered by :func:`init`: shutdown's teardown, before the interpreter finalizes."""
    import gc

    import torch.distributed as tdist

    gc.collect()  # main() has returned: its DDP model is garbage now
    _close_agreement()
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
    _quiesce()
