"""One rank of a Trainer run over a dataset of indices that records what it trains on.

argv[1]: JSON spec with ``config`` (TrainConfig mapping), ``n`` (samples) and ``log_dir``:
each rank appends ``epoch index index ...`` per micro-batch to ``<log_dir>/<rank>.txt``
(the epoch as the sampler was last set to it, in this process).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import Dataset


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def main() -> None:
    spec = json.loads(sys.argv[1])
    import ddp
    from ddp import parts
    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    current = {"epoch": -1}
    real_set_epoch = parts.GlobalOrderSampler.set_epoch

    def set_epoch(self: parts.GlobalOrderSampler, epoch: int) -> None:
        current["epoch"] = epoch
        real_set_epoch(self, epoch)

    parts.GlobalOrderSampler.set_epoch = set_epoch  # type: ignore[method-assign]
    rank = int(os.environ.get("RANK", "0"))
    log = open(os.path.join(spec["log_dir"], f"{rank}.txt"), "a")  # noqa: SIM115

    def step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        ids = " ".join(str(int(v)) for v in batch.flatten().tolist())
        log.write(f"{current['epoch']} {ids}\n")
        log.flush()
        return (model(batch / 100.0) ** 2).mean()

    torch.manual_seed(0)
    Trainer(nn.Linear(1, 1), Indices(spec["n"]), TrainConfig.from_dict(spec["config"]), step).fit()
    ddp.shutdown()


if __name__ == "__main__":
    main()
