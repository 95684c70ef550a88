"""Joining the job's rendezvous: the collective timeout, the master's address (one name
look-up per rank) and the job's TCPStore, with one-line errors for a taken port or a rank 0
that never started.

Split from :mod:`ddp.dist`, which re-exports every name here: ``ddp.dist.init`` looks
:func:`resolve_master` and :func:`rendezvous_store` up through ``ddp.dist`` (tests and
bench/scale_dist.py replace them there). The tunables (:data:`STORE_ANSWER_S`,
:data:`PROBE_FIRST_S`, ...) are read here, so a test that shortens them sets them on this
module.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ddp.config import MAX_SECONDS
from ddp.env import DistEnv, timeout_from_environ
from ddp.errors import ConfigError

log = logging.getLogger("ddp")

DEFAULT_TIMEOUT_S = 1800.0


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
    ``_create_c10d_store``. Left whole past 60 lines: the client thread, the probes and the
    three failure lines share one deadline and one answer box.
    """
    import threading
    import time

    from torch.distributed import TCPStore

    port = info.master_port
    host = address or info.master_addr
    where = f"MASTER_ADDR:MASTER_PORT {info.master_addr}:{port}"
    if info.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        try:
            return TCPStore(
                host,
                port,
                info.world_size,
                True,
                timeout,
                wait_for_workers=False,
                multi_tenant=True,
                use_libuv=_use_libuv(),
            )
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
            f"nothing accepted connections at {where} within {limit_s:.0f} s; did rank 0 start?"
        )
    if box:
        raise box[0]
    raise ConfigError(f"{where}: no rendezvous store answered within {limit_s:.0f} s")
