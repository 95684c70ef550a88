"""Two "hosts" on one machine: a pair of network namespaces joined by a veth pair.

Why: multi-node rendezvous (MASTER_ADDR, c10d, GLOO_SOCKET_IFNAME) must be tested with two
distinct IP stacks, not 127.0.0.1. Addresses 10.200.0.1/24 and 10.200.0.2/24 exist only
inside the namespaces made here; the host's own interfaces are never touched. Names carry
the pid (and a counter), so parallel sessions do not clash; pairs left by a dead process
are deleted at the next creation. Processes run via ``nsenter --net=/run/netns/NAME`` (not
``ip netns exec``, which remounts /sys and breaks slurmd). In every namespace the hostname
still resolves to 127.0.0.1: pass the namespace address explicitly (``--local_addr``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "hddp"
ADDRESSES = ("10.200.0.1", "10.200.0.2")
PREFIXLEN = 24
_counter = itertools.count()
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)x\d+[ab]$")


def missing_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for exe in ("ip", "nsenter"):
        if shutil.which(exe) is None:
            return f"'{exe}' not found (iproute2 / util-linux)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_netns() -> list[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def cleanup_stale() -> list[str]:
    """Delete namespaces of ours whose creating process is gone (veths go with them)."""
    removed = []
    for name in list_netns():
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "delete", name)
                removed.append(name)
    return removed


@dataclass
class NetnsPair:
    """Two namespaces; index 0 has ``addresses[0]`` on ``veths[0]``, index 1 the other."""

    names: tuple[str, str]
    veths: tuple[str, str]
    addresses: tuple[str, str] = ADDRESSES
    prefixlen: int = PREFIXLEN
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def netns_path(self, index: int) -> str:
        return f"/run/netns/{self.names[index]}"

    def prefix(self, index: int) -> list[str]:
        """argv prefix that runs a command in namespace ``index`` (for other launchers)."""
        return ["nsenter", f"--net={self.netns_path(index)}", "--"]

    def run(
        self,
        index: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen_kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside namespace ``index``; it is killed at teardown if still alive."""
        proc = subprocess.Popen(  # type: ignore[call-overload]
            [*self.prefix(index), *argv],
            env=dict(env) if env is not None else None,
            **popen_kwargs,
        )
        self.procs.append(proc)
        return proc

    def check_output(self, index: int, argv: Sequence[str], timeout: float = 30) -> str:
        return subprocess.run(
            [*self.prefix(index), *argv],
            capture_output=True,
            text=True,
            check=True,
            timeout=timeout,
        ).stdout


def create_pair() -> NetnsPair:
    n = next(_counter)
    tag = f"{os.getpid()}x{n}"
    names = (f"{PREFIX}{tag}a", f"{PREFIX}{tag}b")
    veths = (f"vh{tag}a", f"vh{tag}b")  # <= 15 chars (IFNAMSIZ)
    pair = NetnsPair(names=names, veths=veths)
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for name, veth, addr in zip(names, veths, ADDRESSES, strict=True):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/{PREFIXLEN}", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except BaseException:
        destroy_pair(pair)
        raise
    return pair


def destroy_pair(pair: NetnsPair) -> None:
    """Kill processes started with ``run``, then delete both namespaces (and the veths)."""
    for proc in pair.procs:
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
    for name in pair.names:
        if Path(f"/run/netns/{name}").exists():
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "delete", name)
    # a veth not yet moved into a namespace lives in the host namespace
    with contextlib.suppress(subprocess.CalledProcessError):
        if Path(f"/sys/class/net/{pair.veths[0]}").exists():
            _ip("link", "delete", pair.veths[0])


@contextlib.contextmanager
def netns_pair_ctx() -> Iterator[NetnsPair]:
    cleanup_stale()
    pair = create_pair()
    try:
        yield pair
    finally:
        destroy_pair(pair)
