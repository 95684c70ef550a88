"""ddp.init / wrap / reductions in one process (the world-1 path every laptop takes)."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.ddp.launch_utils import clean_env
from tests.support.ports import free_port

SCRIPT = r"""
import torch, ddp
ctx = ddp.init(timeout=30)
assert ctx is ddp.init()
assert (ctx.rank, ctx.world_size, ctx.launcher, ctx.backend) == (0, 1, "single", "gloo")
assert ddp.is_main_process() and not ctx.distributed
m = torch.nn.Linear(2, 2)
assert ddp.wrap(m) is m
assert ddp.reduce_mean(torch.tensor([3.0])).item() == 3.0
assert ddp.reduce_sum(torch.tensor([3])).item() == 3
assert ddp.all_gather_object({"a": 1}) == [{"a": 1}]
ddp.barrier()
ddp.print0("printed-by-rank-0")
ddp.shutdown()
assert ddp.get_context() is None
"""


def test_world_one_without_launcher():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "Initialized DDP: rank=0, world_size=1, local_rank=0" in out.stdout
    assert "Using device: cpu" in out.stdout
    assert "printed-by-rank-0" in out.stdout


def test_exec_reports_bad_launcher_env_in_one_line():
    env = clean_env(RANK="5", LOCAL_RANK="0", WORLD_SIZE="2")
    out = subprocess.run(
        [sys.executable, "-m", "ddp.exec", "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "RANK=5 is not below WORLD_SIZE=2" in out.stderr


def test_exec_exports_torchrun_variables():
    env = clean_env(
        PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2", MASTER_PORT="12345"
    )
    code = (
        "import os; print(*[os.environ[k] for k in ('RANK','LOCAL_RANK','WORLD_SIZE',"
        "'LOCAL_WORLD_SIZE','GROUP_RANK','MASTER_ADDR','MASTER_PORT')])"
    )
    out = subprocess.run(
        [sys.executable, "-m", "ddp.exec", "--", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "2", "2", "0", "localhost", "12345"]


def test_exec_usage_errors():
    out = subprocess.run(
        [sys.executable, "-m", "ddp.exec"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "no command given" in out.stderr


def test_unresolvable_master_fails_at_once_in_one_line():
    env = clean_env(
        RANK="1",
        LOCAL_RANK="1",
        WORLD_SIZE="2",
        MASTER_ADDR="no-such-host.invalid",
        MASTER_PORT="23456",
    )
    out = subprocess.run(
        [sys.executable, "-c", "import ddp; ddp.init(timeout=300)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "ddp: error: master address 'no-such-host.invalid' (torchrun) does not resolve; set "
        "MASTER_ADDR, or DDP_MASTER_ADDR_SUFFIX to the site's host-name suffix"
    ]


def test_site_suffix_falls_back_to_bare_host(tmp_path):
    """Aurora's profile appends .hsn...; off Aurora the bare node name must still work."""
    nodefile = tmp_path / "nodes"
    nodefile.write_text("localhost\n")
    env = clean_env(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        PBS_NODEFILE=str(nodefile),
        DDP_MASTER_ADDR_SUFFIX=".hsn.cm.aurora.alcf.anl.gov",
    )
    env.pop("RANK")
    env.pop("LOCAL_RANK")
    env.update(
        PMI_RANK="0",
        PMI_SIZE="2",
        PMI_LOCAL_RANK="0",
        PALS_RANKID="0",
        PALS_LOCAL_RANKID="0",
        MASTER_PORT="23457",
    )
    code = (
        "import ddp.dist as d, ddp.env as e; info = d.check_resolves(e.detect()); "
        "print(info.master_addr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "localhost"


# ---- rendezvous at scale (issue 28) ---------------------------------------------------------
class _CountingProxy:
    """Forwards every connection to ``port`` and counts the connections it accepted."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                conn.close()
                continue
            self.socks += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


def _wait_listening(port: int, proc: subprocess.Popen, limit_s: float = 60.0) -> None:
    """Until something listens on ``port`` (``proc`` starting it); the bound is for a hang."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listened on {port}: {proc.poll()}")


RENDEZVOUS = r"""
import ipaddress, json, socket, sys
import torch.distributed as tdist
names, hosts = [], []
real_gai, real_store = socket.getaddrinfo, tdist.TCPStore

def gai(host, *a, **k):
    try:
        ipaddress.ip_address(host)
    except ValueError:
        names.append(host)  # a name, not a number: a look-up in the name service
    return real_gai(host, *a, **k)

def store(host, *a, **k):
    hosts.append(host)
    return real_store(host, *a, **k)

socket.getaddrinfo, tdist.TCPStore = gai, store
import ddp, ddp.rendezvous
ddp.rendezvous.PROBE_FIRST_S = 20.0  # "at once" on a loaded machine: no probe unless silent 10 s
ddp.init(timeout=60)
print(json.dumps({"names": names, "store_hosts": hosts}))
ddp.shutdown()
"""


def test_rendezvous_looks_up_the_master_once_and_probes_only_a_silent_store():
    """Each rank asks the name service once (TCPStore is given the number), and a rank
    whose store answers at once opens one connection to it: no probe beside it."""
    port = free_port()
    proxy = _CountingProxy(port)
    procs: list[subprocess.Popen] = []
    try:
        for rank, via in ((0, port), (1, proxy.port)):
            env = clean_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="localhost",
                MASTER_PORT=str(via),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", RENDEZVOUS],
                    env=env,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
            if rank == 0:  # the proxy accepts at once: rank 1 starts once the store listens
                _wait_listening(port, procs[0])
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        proxy.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
        rec = json.loads(out.strip().splitlines()[-1])
        assert rec["names"] == ["localhost"], rec
        assert rec["store_hosts"] and all(ipaddress.ip_address(h) for h in rec["store_hosts"])
    assert proxy.accepted == 1


def test_handshake_budget_grows_with_the_world_and_stops_at_the_timeout():
    from ddp import dist

    small, big = dist.handshake_budget(2, 1800.0), dist.handshake_budget(127_488, 1800.0)
    assert small == pytest.approx(dist.STORE_ANSWER_S, abs=0.01)
    assert big > small + 100  # 127k clients queue at one store thread
    assert dist.handshake_budget(127_488, 30.0) == 30.0


def test_probes_back_off_with_jitter_up_to_a_cap():
    from ddp import dist

    delays = list(itertools.islice(dist.probe_delays(), 12))
    caps = [min(dist.PROBE_FIRST_S * 2**i, dist.PROBE_CAP_S) for i in range(12)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, caps, strict=True)), delays
    assert caps[-1] == dist.PROBE_CAP_S and len(set(delays)) > 6  # jittered, not in step


def test_no_rank_0_is_one_line_and_no_store_client_noise():
    """Nothing listens: the rank stops at its timeout with one line, before torch's store
    client gives up and logs its retries with C++ stacks (the client starts at once)."""
    env = clean_env(
        RANK="1",
        LOCAL_RANK="1",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    out = subprocess.run(
        [sys.executable, "-c", "import ddp; ddp.init(timeout=3)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"ddp: error: nothing accepted connections at MASTER_ADDR:MASTER_PORT "
        f"127.0.0.1:{env['MASTER_PORT']} within 3 s; did rank 0 start?"
    ]
