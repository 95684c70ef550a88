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
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddp import backends, heartbeat
from ddp._pipes import OutputHandler
from ddp.config import MAX_SECONDS
from ddp.env import DistEnv, detect, timeout_from_environ
from ddp.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ddp.agree import Agreement, GroupAgreement

log = logging.getLogger("ddp")

DEFAULT_TIMEOUT_S = 1800.0


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


def _timeout(value: float | timedelta | None) -> timedelta:
    """The collective timeout: ``value`` if given, else ``$DDP_TIMEOUT``, else
    ``$NCCL_TIMEOUT`` (the seeds' advice, seconds), else 1800 s."""
    return _timeout_and_source(value)[0]


def _timeout_and_source(value: float | timedelta | None) -> tuple[timedelta, str]:
    """(the timeout, where it came from: for the log line that says which is in effect)."""
    source = "ddp.timeout_s or ddp.init(timeout=...)"
    if value is None:
        found = timeout_from_environ()
        source = "default"
        value = DEFAULT_TIMEOUT_S
        if found is not None:
            source, raw = found
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(f"{source}={raw!r} is not a number of seconds") from None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    # NaN fails both comparisons; past MAX_SECONDS, timedelta or torch's C++ milliseconds
    # overflow (OverflowError, after the config was accepted).
    if not (isinstance(seconds, int | float) and 0 < seconds <= MAX_SECONDS):
        raise ConfigError(
            f"timeout={value!r}; allowed: seconds > 0 and at most {MAX_SECONDS:.0f} (a year) "
            "(ddp.init(timeout=...), ddp.timeout_s, DDP_TIMEOUT or NCCL_TIMEOUT)"
        )
    limit = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
    return limit, source


#: pytorch#156782 (https://github.com/pytorch/pytorch/issues/156782): XCCL ``Send``/``Recv``
#: (and gather, scatter, grouped collectives) "may get stuck" on torch 2.8; the workaround
#: is "CCL_SEND=direct and CCL_RECV=direct", fixed in 2.9. Known only on the node (the
#: torch the job imports), so the compute side sets it, before the process group exists.
XCCL_P2P_FIX = {"CCL_SEND": "direct", "CCL_RECV": "direct"}


def xccl_p2p_env(device_type: str, torch_version: str,
                 environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The variables to set for pytorch#156782: on XPU with torch 2.8.x only, and never
    over a value the user set (``CCL_SEND=...`` in the job wins)."""
    release = torch_version.split("+", 1)[0].split(".")
    if device_type != "xpu" or release[:2] != ["2", "8"]:
        return {}
    return {k: v for k, v in XCCL_P2P_FIX.items() if k not in environ}


#: ezpz PR #149 (https://github.com/saforem2/ezpz/pull/149, Aurora job 8518207): FSDP2 on
#: XPU deadlocked on its first ``all_gather_into_tensor`` until the default group was made
#: with ``init_process_group(device_id=xpu:N)`` after ``torch.xpu.set_device(N)``: unbound,
#: xccl routed some ranks' collectives to ``xpu:0`` and others to ``xpu:LOCAL_RANK``.
#: Bound on every XPU job, not only FSDP2 ones: ``init`` runs before the strategy is known,
#: and torch 2.13's Python side does little else with it on the paths this project takes
#: (distributed_c10d.py: ``init_process_group`` stores it as ``pg.bound_device_id``,
#: 2095-2096; eager connect only for a backend that ``supports_splitting``, 2333-2335;
#: ``barrier`` takes it as its device, 5332-5334; DeviceMesh's ``split_group``, 564, is
#: for a mesh dimension smaller than the world, device_mesh.py 523, and ddp.fsdp's mesh
#: is 1-D over every rank). ``new_group`` inherits it: see :func:`_unbound_default_group`.
#: Device type -> the backends whose default group is bound. Not on nccl: its binding
#: also switches on eager communicators and ``ncclCommSplit`` (a change of its own, not
#: this fix); never on gloo, which has no backend for the accelerator (backend_capability).
BIND_DEVICE_ID: dict[str, tuple[str, ...]] = {"xpu": ("xccl",)}


def bound_device(device: torch.device, backend: str) -> torch.device | None:
    """The ``device_id`` to make the default group with (:data:`BIND_DEVICE_ID`): the
    device this rank was just set to, or None where the rule does not apply."""
    if device.index is None or backend not in BIND_DEVICE_ID.get(device.type, ()):
        return None
    return device


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
            log.info("torch %s on xpu: %s (pytorch#156782, fixed in 2.9)", torch.__version__,
                     " ".join(f"{k}={v}" for k, v in fix.items()))  # fmt: skip
    if info.world_size > 1 and not tdist.is_initialized():
        atexit.register(_at_exit)
        info, address = resolve_master(info)
        os.environ.update(info.torchrun_vars())  # for libraries that read env:// themselves
        store = rendezvous_store(info, limit, address)
        bound = bound_device(choice.device, choice.backend)  # after _set_device (ezpz #149)
        tdist.init_process_group(
            backend=choice.backend,
            # The prefix torch's own init_method path adds: keys never meet an agent's.
            store=tdist.PrefixStore("default_pg", store),
            rank=info.rank,
            world_size=info.world_size,
            timeout=limit,
            **({"device_id": bound} if bound is not None else {}),
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
        info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank,
        choice.device, choice.backend, info.launcher, info.master_addr, info.master_port,
        limit.total_seconds(),
    )  # fmt: skip
    log.info(
        "Initialized DDP: rank=%d, world_size=%d, local_rank=%d",
        info.rank, info.world_size, info.local_rank,
    )  # fmt: skip
    log.info("Using device: %s", choice.device)
    log.info("collective timeout: %g s (%s)", limit.total_seconds(), limit_source)
    for note in info.notes if info.rank == 0 else ():  # the same on every rank: say it once
        log.warning("%s", note)
    log.debug("launcher=%s backend=%s master=%s:%d", info.launcher, choice.backend,
              info.master_addr, info.master_port)  # fmt: skip
    return _CONTEXT


def _address(host: str, port: int) -> str | None:
    """The first address ``host`` resolves to (one look-up), or None when it has none.

    TCPStore tries the same first address when given the name; rank 0's store listens
    on every interface and both families, so the numeric form reaches it the same way."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):  # UnicodeError: a label IDNA cannot encode
        return None
    return str(found[0][4][0]) if found else None


def resolve_master(info: DistEnv) -> tuple[DistEnv, str]:
    """``info`` (with the bare host when the site suffix does not resolve) and the master's
    numeric address: the one name look-up of this rank.

    Everything after it (the probes, TCPStore, rank 0's own client) is given the number,
    so 127k ranks ask the name service once each, not once per probe. Fails in a second,
    not after the store's timeout, when the master host has no address. A derived host
    with ``DDP_MASTER_ADDR_SUFFIX`` that does not resolve falls back to the bare host
    name (every rank takes the same decision from the same DNS; the only case with a
    second look-up), so a site suffix in a cluster profile does not break a node without
    that network.
    """
    address = _address(info.master_addr, info.master_port)
    if address is not None:
        return info, address
    suffix = os.environ.get("DDP_MASTER_ADDR_SUFFIX", "")
    if suffix and not os.environ.get("MASTER_ADDR") and info.master_addr.endswith(suffix):
        bare = info.master_addr[: -len(suffix)]
        address = _address(bare, info.master_port)
        if address is not None:
            log.warning("master %s does not resolve; using %s", info.master_addr, bare)
            return replace(info, master_addr=bare), address
    raise ConfigError(
        f"master address {info.master_addr!r} ({info.launcher}) does not resolve; "
        "set MASTER_ADDR, or DDP_MASTER_ADDR_SUFFIX to the site's host-name suffix"
    )


def check_resolves(info: DistEnv) -> DistEnv:
    """:func:`resolve_master` without the address (``ddp.exec``: the script it starts
    resolves again in its own ``ddp.init``)."""
    return resolve_master(info)[0]


STORE_ANSWER_S = 60.0
"""How long a store that accepts connections may take to answer a client, at small scale.

A TCPStore answers in milliseconds; past this the program on the port is not one. The
budget grows with the world (:func:`handshake_budget`): every rank connects at once, and
rank 0's one store thread answers them in turn."""

STORE_ANSWER_PER_RANK_S = 1e-3
"""Added to the budget per rank (127 s at 127,488 ranks): ~4x what one client's handshake
and torch's init barrier (about 5 requests) cost rank 0's store at the slowest rate
measured on a shared 2-core machine (18k requests/s, bench/scale_dist.py)."""

PROBE_FIRST_S = 1.0
"""The first probe for a listener, if the store has not answered by then."""

PROBE_CAP_S = 10.0
"""Probes back off (doubling, with jitter) up to this interval."""


def handshake_budget(world_size: int, timeout_s: float) -> float:
    """Seconds a listening store may take to answer: :data:`STORE_ANSWER_S` plus
    :data:`STORE_ANSWER_PER_RANK_S` per rank, and never past the collective timeout."""
    return min(timeout_s, STORE_ANSWER_S + world_size * STORE_ANSWER_PER_RANK_S)


def _use_libuv() -> bool:
    """torch's own choice for its TCPStore (libuv unless ``USE_LIBUV=0``): the libuv
    server is the one built for tens of thousands of clients."""
    return os.environ.get("USE_LIBUV", "1") == "1"


def probe_delays() -> Iterator[float]:
    """Seconds before each probe for the store's listener: :data:`PROBE_FIRST_S`, doubling up
    to :data:`PROBE_CAP_S`, each drawn from the upper half of its interval (jitter: ranks
    that started together do not probe in step)."""
    import random

    delay = PROBE_FIRST_S
    while True:
        yield delay * random.uniform(0.5, 1.0)
        delay = min(delay * 2, PROBE_CAP_S)


def _accepts(address: str, port: int) -> bool:
    """One connection attempt: does something listen at ``address:port``?"""
    try:
        socket.create_connection((address, port), timeout=5).close()
    except OSError:
        return False
    return True


def rendezvous_store(info: DistEnv, timeout: timedelta, address: str | None = None) -> Any:
    """The job's TCPStore (libuv), with a one-line error on every rank when the port is taken.

    ``address``: the master's numeric address from :func:`resolve_master` (default: the
    host name, looked up again). ``init_process_group(init_method="tcp://...")`` builds the
    same store, but when another program holds MASTER_PORT rank 0 dies with a 30-line
    traceback and the other ranks connect to that program and wait for an answer that
    never comes, whatever the timeout (TCPStore's handshake has none). Here rank 0
    reports the taken port in one line; every other rank starts its client at once and,
    only if it has no answer yet, probes for a listener with backing-off, jittered
    intervals (:data:`PROBE_FIRST_S` doubling to :data:`PROBE_CAP_S`: a rank whose store
    answers at once opens no extra connection, and a late rank 0 is not met by 127k
    ranks probing in step). From the first probe that finds a listener the store has
    :func:`handshake_budget` seconds to answer; with none by ``timeout`` rank 0 never
    started. Under torchrun the elastic agent already hosts the store
    (``TORCHELASTIC_USE_AGENT_STORE=True``), so every rank is a client, as in torch's own
    ``_create_c10d_store``.
    """
    import threading
    import time

    from torch.distributed import TCPStore

    port = info.master_port
    host = address or info.master_addr
    where = f"MASTER_ADDR:MASTER_PORT {info.master_addr}:{port}"
    if info.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        try:
            return TCPStore(host, port, info.world_size, True, timeout, wait_for_workers=False,
                            multi_tenant=True, use_libuv=_use_libuv())  # fmt: skip
        except RuntimeError as exc:  # DistNetworkError
            if "EADDRINUSE" in str(exc) or "address already in use" in str(exc):
                raise ConfigError(
                    f"port {port} is already in use on this host (rank 0 hosts the job's "
                    "rendezvous store there); set MASTER_PORT to a free port"
                ) from None
            raise
    box: list[Any] = []
    answered = threading.Event()

    limit_s = timeout.total_seconds()
    # The client outlives the deadline below: when nothing listens, this rank stops with
    # its one line before torch's client times out and logs its retries with C++ stacks.
    patience = timeout + timedelta(seconds=PROBE_CAP_S + 30.0)

    def connect() -> None:
        try:
            store = TCPStore(host, port, info.world_size, False, patience)
            store.set_timeout(timeout)  # the job's own limit for every later request
            box.append(store)
        except BaseException as exc:  # handed to the caller below
            box.append(exc)
        answered.set()

    threading.Thread(target=connect, name="ddp-store-connect", daemon=True).start()
    budget = handshake_budget(info.world_size, limit_s)
    deadline = time.monotonic() + limit_s
    listening = False
    for delay in probe_delays():
        left = deadline - time.monotonic()
        if left <= 0 or answered.wait(min(delay, left)):
            break
        if _accepts(host, port):
            listening = True
            if not answered.wait(budget):
                raise ConfigError(
                    f"{where} accepts connections but does not answer as the job's "
                    f"rendezvous store within {budget:.0f} s: another program holds the "
                    "port; set MASTER_PORT to a free port"
                )
            break
    if box and not isinstance(box[0], BaseException):
        return box[0]
    if not listening and not _accepts(host, port):
        raise ConfigError(
            f"nothing accepted connections at {where} within {limit_s:.0f} s; "
            "did rank 0 start?"
        )
    if box:
        raise box[0]
    raise ConfigError(f"{where}: no rendezvous store answered within {limit_s:.0f} s")


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


@contextmanager
def _unbound_default_group() -> Iterator[None]:
    """The default group's ``bound_device_id`` (:data:`BIND_DEVICE_ID`) cleared while a
    CPU (Gloo) group is made, then put back.

    torch 2.13's ``new_group`` gives the new group the default group's bound device
    (distributed_c10d.py 5963-5964, ``device_id = default_pg.bound_device_id``); an
    explicit other one is refused ("Mismatched bound device", 5965-5969), and ``cpu`` is
    refused anyway (2014-2017). The Gloo group would then be bound to ``xpu:N`` and
    ``new_group`` fails at its eager-connect check, ``pg._get_backend(device_id)``
    (2333): "No backend type associated with device type xpu" (Gloo serves cpu and cuda
    only). Cleared, the Gloo group is unbound and its collectives (and ``barrier``, which
    takes a bound device as its own, 5332-5334) stay on the CPU. Only the Python-side
    record changes: each backend got its own copy when it was registered
    (ProcessGroup.hpp ``setBackend``), so the default group's XCCL keeps its device.
    ezpz clears it the same way around ``init_device_mesh`` (``init_device_mesh_safe``,
    PR #149). Called on the main thread between steps (checkpoint saves), when no other
    group is being made."""
    import torch.distributed as tdist

    default = tdist.group.WORLD
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


@contextmanager
def _lazy_gloo() -> Iterator[None]:
    """Gloo groups made inside connect their pairs on first use (torch reads
    ``TORCH_GLOO_LAZY_INIT`` when it makes a group's device; ``new_group`` takes no Gloo
    options). The caller's own setting is restored after."""
    old = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = old


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


def wrap(
    model: torch.nn.Module, strategy: str = "ddp", **options: Any
) -> torch.nn.Module:
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


def _quiesce(limit_s: float = 2.0) -> None:
    """Wait, with the GIL released, until Gloo's worker threads are idle.

    torch 2.13 never frees a Gloo group after ``destroy_process_group`` (C++ keeps it),
    so its worker threads run until the process ends. A worker that finishes a
    collective after the caller moved on still holds the input tensor; when it drops
    the last reference after the interpreter started finalizing, freeing the tensor's
    Python object needs the GIL, CPython ends the thread with ``pthread_exit``, and the
    forced unwind through a C++ destructor aborts the process: "terminate called
    without an active exception" (a core dump of this project's 2-node srun test shows
    exactly that stack, under CPU contention). Sleeping here hands such a worker the
    GIL while Python is whole; the wait ends once no ``pt_gloo_runloop`` thread is
    runnable in two successive looks (Linux /proc), or after ``limit_s``.
    """
    import time

    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
        quiet = quiet + 1 if not _gloo_busy() else 0


def _gloo_busy() -> bool:
    """True while a Gloo worker thread of this process is running or runnable."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False  # not Linux: the sleeps above are all there is
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        if name.startswith("pt_gloo") and stat[stat.rfind(")") + 2] == "R":
            return True
    return False
