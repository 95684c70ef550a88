"""An unmodified torchrun-style script: no ddp import, ``init_method="env://"``.

Run through ``python -m ddp.exec --`` it must work under srun, MPICH, PALS and
Open MPI. Writes ``rank<N>.json`` (weights digest, all-reduce result, GROUP_WORLD_SIZE
and ``is_torchelastic_launched()``) into argv[1].
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)  # different data per rank
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        opt.step()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    Path(sys.argv[1], f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world_size": world,
                "local_rank": int(os.environ["LOCAL_RANK"]),
                # What torchrun-launched scripts (TorchX's examples) read; KeyError if missing.
                "group_world_size": int(os.environ["GROUP_WORLD_SIZE"]),
                "elastic": dist.is_torchelastic_launched(),
                "digest": hashlib.sha256(repr(flat.tolist()).encode()).hexdigest(),
                "reduce_mean": t.item() / world,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13 keeps a Gloo group's worker threads alive after destroy_process_group;
    # one that frees a collective's tensor while the interpreter finalizes aborts the
    # process ("terminate called without an active exception"; see ddp.dist._quiesce,
    # which ddp.init/ddp.shutdown use). A plain script skips finalization instead: all
    # its work and files are done and flushed here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
