"""A small real DDP training run used by the launcher tests.

Uses only ``ddp`` for setup. Every rank writes ``rank<N>.json`` into the folder
given as argv[1]: its detected identity, a digest of its final weights, and the
result of ``reduce_mean`` over the ranks' values (rank + 1), so a test can check
identical weights and correct reductions under any launcher.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddp


def main() -> None:
    # The legacy launcher inserts --local-rank=N before the script's own arguments.
    out = Path(next(a for a in sys.argv[1:] if not a.startswith("--local")))
    ctx = ddp.init(backend="auto", device="cpu", timeout=120)
    torch.manual_seed(0)
    model = ddp.wrap(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    sampler = DistributedSampler(
        data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=3
    )
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    flat = torch.cat([p.detach().flatten() for p in ddp.unwrap(model).parameters()])
    mean = ddp.reduce_mean(torch.tensor([float(ctx.rank + 1)]))
    record = {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "local_world_size": ctx.local_world_size,
        "node_rank": ctx.node_rank,
        "launcher": ctx.launcher,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "digest": hashlib.sha256(repr(flat.tolist()).encode()).hexdigest(),
        "reduce_mean": mean.item(),
    }
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
    ddp.barrier()
    ddp.shutdown()


if __name__ == "__main__":
    main()
