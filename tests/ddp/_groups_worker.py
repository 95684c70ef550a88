"""One rank of a job that counts what ``ddp.init`` adds beside the main process group.

argv: the output folder. Counts, on this rank, the sockets (``/proc/self/fd`` links to
``socket:``) and the store requests (a wrapper around the job's store: one count per
``set``/``get``/``add``/``wait``/... call, whoever makes it) between the moment
``init_process_group`` returns and the moment ``ddp.init`` returns: the side groups'
cost, apart from the default group's. Then the same for ``ddp.dist.checkpoint_group()``,
and whether a flag raised on one rank reaches every rank.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import torch.distributed as tdist


def sockets() -> int:
    """This process's open sockets (listening and connected)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


class Counting(tdist.Store):
    """The job's store, counting each request this process makes to it."""

    def __init__(self, inner: tdist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()

    def set(self, key, value):  # noqa: ANN001, ANN201
        self.calls["set"] += 1
        return self.inner.set(key, value)

    def get(self, key):  # noqa: ANN001, ANN201
        self.calls["get"] += 1
        return self.inner.get(key)

    def add(self, key, value):  # noqa: ANN001, ANN201
        self.calls["add"] += 1
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):  # noqa: ANN001, ANN201
        self.calls["compare_set"] += 1
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):  # noqa: ANN001, ANN201
        self.calls["wait"] += 1
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):  # noqa: ANN001, ANN201
        self.calls["check"] += 1
        return self.inner.check(keys)

    def delete_key(self, key):  # noqa: ANN001, ANN201
        self.calls["delete_key"] += 1
        return self.inner.delete_key(key)

    def num_keys(self):  # noqa: ANN201
        self.calls["num_keys"] += 1
        return self.inner.num_keys()

    def set_timeout(self, timeout):  # noqa: ANN001, ANN201
        return self.inner.set_timeout(timeout)

    def total(self) -> int:
        return sum(self.calls.values())


def main() -> None:
    out = Path(sys.argv[1])
    import ddp
    import ddp.dist

    boxes: list[Counting] = []
    real_store = ddp.dist.rendezvous_store

    def counted_store(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        boxes.append(Counting(real_store(*args, **kwargs)))
        return boxes[-1]

    marks: dict[str, int] = {}
    real_init = tdist.init_process_group

    def init_pg(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
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
    record["gathered"] = ddp.all_gather_object(ctx.rank, group=group)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
    ddp.shutdown()


if __name__ == "__main__":
    main()
