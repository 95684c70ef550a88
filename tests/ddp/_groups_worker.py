"""One rank of a job that counts what ``ddp.init`` adds beside the main process group.

argv: the output folder. Counts, on this rank, the sockets (``/proc/self/fd`` links to
``socket:``) and the store requests (a wrapper around the job's store: one count per
``set``/``get``/``add``/``wait``/... call, whoever makes it) between the moment
``init_process_group`` returns and the moment ``ddp.init`` returns: the side groups'
cost, apart from the default group's. Then the same for ``ddp.dist.checkpoint_group()``,
and whether a flag raised on one rank reaches every rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as tdist

from bench.scale_dist import Counting, sockets  # the benchmark's own counters


def main() -> None:
    out = Path(sys.argv[1])
    import ddp
    import ddp.dist

    boxes: list[Any] = []
    real_store = ddp.dist.rendezvous_store

    def counted_store(*args, **kwargs):
        boxes.append(Counting(real_store(*args, **kwargs)))
        return boxes[-1]

    marks: dict[str, int] = {}
    real_init = tdist.init_process_group

    def init_pg(*args, **kwargs):
        real_init(*args, **kwargs)
        marks["sockets"] = sockets()
        marks["requests"] = boxes[0].total()

    ddp.dist.rendezvous_store = counted_store
    tdist.init_process_group = init_pg
    ctx = ddp.init(timeout=60)
    record: dict = {
        "rank": ctx.rank,
        "extra_sockets": sockets() - marks["sockets"],
        "extra_requests": boxes[0].total() - marks["requests"],
    }
    any_rank = getattr(ddp.dist, "any_rank", None)
    if any_rank is not None:
        record["none"] = any_rank(False)
        record["one"] = any_rank(ctx.rank == ctx.world_size - 2)
    before = sockets()
    group = ddp.dist.checkpoint_group()
    record["checkpoint_sockets"] = sockets() - before
    ddp.barrier()  # no rank's first collective on it connects to a rank still counting
    record["gathered"] = ddp.all_gather_object(ctx.rank, group=group)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
    ddp.shutdown()


if __name__ == "__main__":
    main()
