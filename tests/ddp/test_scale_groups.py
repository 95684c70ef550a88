"""The side channels of ``ddp.init`` cost each rank O(1) beside the main backend (issue 28).

The preemption vote and FSDP's lockstep evaluation agree on one flag over a tree of
small Gloo groups (``ddp.agree``), not a Gloo group of every rank (which connects every
pair: W sockets per rank, W^2 address look-ups at rank 0's store, a ring of 2(W-1) hops
per vote). ``bench/scale_dist.py`` measures the curves from 2 to 64 ranks; these tests
pin the shape (pure arithmetic) and one real 8-rank job in 2 simulated nodes.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.ddp import _launch

WORKER = "tests/ddp/_groups_worker.py"


def _layouts(world: int, block: int) -> list:
    from ddp.agree import Layout

    return [Layout(r, world, block) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 7, 8, 9, 12, 13, 33, 64, 65, 100, 257])
@pytest.mark.parametrize("block", [1, 2, 4, 12, 16])
def test_the_tree_joins_every_rank_with_a_bounded_degree(world, block):
    from ddp.agree import FANOUT

    lay = _layouts(world, block)
    assert sum(len(x.children) for x in lay) == world - 1  # a tree: W - 1 edges
    for x in lay:
        assert len(x.groups) <= 2
        for c in x.children:
            assert lay[c].parent == x.rank
        for g in x.groups:
            assert x.rank in x.members(g) and len(x.members(g)) <= block + FANOUT
        hops, r = 0, x.rank
        while lay[r].parent is not None:
            r, hops = lay[r].parent, hops + 1
        assert r == 0 and hops <= x.depth
    deepest = max(_depth(lay, r) for r in range(world))
    assert all(x.depth == deepest for x in lay)  # every rank knows the same round length


def _depth(lay: list, r: int) -> int:
    d = 0
    while lay[r].parent is not None:
        r, d = lay[r].parent, d + 1
    return d


def test_a_round_grows_with_the_log_of_the_world():
    """Hops of one round: 2 (1 + ceil(log_8 of the blocks)), never more."""
    from ddp.agree import FANOUT, Layout

    for world in (2, 4, 16, 64, 1000, 3072, 75_264, 127_488):
        for block in (1, 4, 8, 12):
            nodes = -(-world // block)
            bound = 2 * (
                (block > 1) + math.ceil(math.log(max(nodes, 1) * (FANOUT - 1) + 1, FANOUT))
            )
            assert Layout(0, world, block).hops <= bound, (world, block)
    assert Layout(0, 127_488, 12).hops == 12  # Aurora: 10,624 nodes x 12 ranks


def test_block_size_comes_from_rank_0_and_a_crafted_value_is_one_line():
    from ddp.agree import BLOCK_KEY, block_size
    from ddp.errors import ConfigError

    store = {}

    class Store:
        def set(self, key, value):
            store[key] = value.encode() if isinstance(value, str) else value

        def get(self, key):
            return store[key]

    assert block_size(Store(), 0, 12) == 12
    assert block_size(Store(), 5, 4) == 12  # rank 0's, whatever this rank's launcher says
    assert block_size(Store(), 0, 500) == 16 and block_size(Store(), 3, None) == 16
    assert block_size(Store(), 0, None) == 1
    for bad in (b"0", b"17", b"\xff\xfe", b"\xd9\xa3", b"-1", b"", b"1e3", "١٢".encode()):
        store[BLOCK_KEY] = bad
        with pytest.raises(ConfigError) as err:
            block_size(Store(), 1, 4)
        assert "\n" not in str(err.value) and "allowed: 1 to 16" in str(err.value)


def test_init_adds_no_group_of_every_rank(tmp_path):
    """8 ranks in 2 simulated nodes of 4: each rank's extra sockets are its tree degree
    plus a listening socket per group; the store's extra requests are a few per rank."""
    world = 8
    procs = _launch.start([WORKER, str(tmp_path)], world=world, local_world=4)
    results = _launch.finish(procs, timeout=180)
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}: {out[-2000:]}\n{err[-3000:]}"
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    from ddp.agree import Layout

    for rec in recs:
        lay = Layout(rec["rank"], world, 4)
        degree = len(lay.children) + (lay.parent is not None)
        assert rec["extra_sockets"] <= degree + len(lay.groups), rec  # a full mesh: 8 each
        assert rec["none"] is False and rec["one"] is True, rec
        assert rec["checkpoint_sockets"] <= 2, rec  # one listener; pairs connect on use
        assert rec["gathered"] == list(range(world))
    # Per rank: a set per group, two look-ups each side of each tree edge, the block size:
    # 6 + 1/block on average at any W (a full mesh: ~2W + 5).
    assert sum(r["extra_requests"] for r in recs) / world <= 7, recs


OWN_GROUP = r"""
import torch.distributed as tdist
tdist.init_process_group("gloo")  # the script's own group: ddp.init builds no tree then
import ddp, ddp.dist
from ddp.preemption import Vote
ctx = ddp.init()
assert ddp.dist.agreement() is not None
first = ddp.dist.any_rank(ctx.rank == 1)
vote = Vote(1, ctx.world_size, ddp.dist.agreement())
assert not vote.step(1, flagged=ctx.rank == 1)  # started at step 1, read at step 2
print(first, ddp.dist.any_rank(False), vote.step(2, flagged=False))
tdist.destroy_process_group()
"""


def test_a_process_group_made_by_the_script_still_agrees():
    """Without ddp.init's tree the default group carries the agreement, as before."""
    procs = _launch.start(["-c", OWN_GROUP], world=2)
    results = _launch.finish(procs, timeout=120)
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}: {err[-3000:]}"
        assert out.split()[-3:] == ["True", "False", "True"], out
