"""The smallest complete DDP training script with hpc-ddp.

Runs unchanged as ``python examples/minimal.py``, under ``torchrun``, ``srun``,
MPICH/PALS ``mpiexec`` and Open MPI: ``ddp.init()`` finds rank, device and backend.
"""

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddp


def main() -> None:
    ctx = ddp.init()
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()  # a learnable rule
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    model = ddp.wrap(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for epoch in range(5):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        total = torch.zeros(2, device=ctx.device)
        for xb, yb in loader:
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * len(xb), torch.tensor(float(len(xb)))])
        total = ddp.reduce_sum(total)  # exact mean over every rank's samples
        ddp.print0(
            f"epoch {epoch + 1}: loss {total[0].item() / total[1].item():.4f} "
            f"(world {ctx.world_size}, {ctx.launcher})"
        )
    ddp.shutdown()


if __name__ == "__main__":
    main()
