"""Two real hosts: a 2-node torchrun c10d rendezvous across two network namespaces.

Each namespace is its own IP stack joined by a veth pair (10.200.0.1 / 10.200.0.2),
so the ranks really talk across a network interface, not loopback.
"""

from __future__ import annotations

import pytest

from tests.ddp.launch_utils import PY, SCRIPTS, assert_consistent, clean_env, records
from tests.support.netns import missing_reason, netns_pair_ctx
from tests.support.parts import require

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


def test_torchrun_two_hosts_c10d(tmp_path):
    why = missing_reason()
    require(why is None, why or "")
    with netns_pair_ctx() as pair:
        host = pair.addresses[0]
        procs = []
        for node in range(2):
            cmd = [
                PY,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"{host}:29611",
                "--rdzv_id",
                "two-hosts",
                "--local_addr",
                pair.addresses[node],
                "--max_restarts",
                "0",
            ]
            if node == 0:
                cmd += ["--rdzv_conf", "is_host=true"]
            cmd += [str(SCRIPTS / "tiny_ddp.py"), str(tmp_path)]
            # The hostname resolves to 127.0.0.1 in every namespace: name the interface.
            env = clean_env(GLOO_SOCKET_IFNAME=pair.veths[node])
            procs.append(pair.run(node, cmd, env=env))
        codes = [p.wait(timeout=180) for p in procs]
        assert codes == [0, 0]
    recs = records(tmp_path, 2)
    assert_consistent(recs)
    assert sorted(r["node_rank"] for r in recs) == [0, 1]
    assert {r["launcher"] for r in recs} == {"torchrun"}
