"""tests.support.ports: the ports test servers are started on, outside the kernel's
ephemeral range (its own picks for client sockets) and ddp's derived job ports."""

from __future__ import annotations

import socket

import pytest

from hpc_ddp.ports import DEFAULT_PORT, PORT_BASE, PORT_SPAN
from tests.support import ports
from tests.support.ports import LOW, ephemeral_start, free_ports


@pytest.mark.skipif(not ports.enough(5), reason="this host's ephemeral range starts too low")
def test_ports_come_from_between_the_job_ports_and_the_ephemeral_range() -> None:
    assert LOW == PORT_BASE + PORT_SPAN
    ports = free_ports(5)
    assert len(set(ports)) == 5
    assert all(LOW <= p < ephemeral_start() and p != DEFAULT_PORT for p in ports), ports
    for port in ports:  # each one can be listened on
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_taken_port_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The taken ports are offered first: each is tried, found bound and passed over."""
    held = []
    try:
        for port in free_ports(3):
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            held.append(s)
        taken = [s.getsockname()[1] for s in held]
        monkeypatch.setattr(
            ports._rng, "sample", lambda pool, k: taken + [p for p in pool if p not in taken]
        )
        got = free_ports(2)
        assert len(got) == 2 and not set(taken) & set(got), (taken, got)
    finally:
        for s in held:
            s.close()
