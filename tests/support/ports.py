"""Free ports for the servers a test starts in a child process (a rank's TCPStore, a
test cluster's slurmctld and slurmd), bound there a moment after they are chosen.

Why not the kernel's pick (a bind to port 0): that comes from the ephemeral range
(``ip_local_port_range``, 32768-60999 by default), which the kernel also hands to every
outgoing connection as its source port. Released and bound again seconds later by a rank
that first imports torch, such a port can meanwhile be a client socket's, and the rank
fails with EADDRINUSE. A port below that range is handed out only by an explicit bind, so
these come from between ddp's derived job ports (``hpc_ddp.ports``: 20000-28999) and the
ephemeral range, at random, each one bound here before it is returned.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from hpc_ddp.ports import DEFAULT_PORT, PORT_BASE, PORT_SPAN

LOW = PORT_BASE + PORT_SPAN
#: Its own generator: a test that seeds ``random`` must not make the choices repeat.
_rng = random.SystemRandom()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def pool() -> list[int]:
    """The ports to choose from: ddp's job ports' end to the ephemeral range, less 29500."""
    return [p for p in range(LOW, ephemeral_start()) if p != DEFAULT_PORT]


def enough(count: int, choices: list[int] | None = None) -> bool:
    """Whether the pool is large enough that ``count`` random picks rarely meet another
    test's (else the kernel picks, as before)."""
    return len(pool() if choices is None else choices) >= 100 * count


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago (held together while chosen, so
    they cannot repeat); the kernel's pick where the range below its own is too small."""
    choices = pool()
    candidates = _rng.sample(choices, len(choices)) if enough(count, choices) else []
    socks: list[socket.socket] = []
    try:
        for port in [*candidates, *[0] * count]:
            if len(socks) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: try the next one
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One port, as :func:`free_ports` chooses them."""
    return free_ports(1)[0]
