"""One rank of a Trainer run over a dataset of indices that records what it trains on.

argv[1]: JSON spec with ``config`` (TrainConfig mapping), ``n`` (samples) and ``log_dir``:
each rank appends ``epoch index index ...`` per micro-batch to ``<log_dir>/<rank>.txt``
(the epoch as the sampler was last set to it, in this process). Issue 30: ``hold``
({"rank", "step", "dir"}) makes that rank write ``dir/ready`` (its pid) before training
step ``step + 1`` and wait for ``dir/released`` (first attempt only), and lines then read
``epoch step index ...``; ``fail_step`` raises the same ValueError on every rank there.
``eval_n``: evaluation data (the step evaluates too; its batches are not logged), and
``signal_in_eval`` sends every rank SIGUSR1 from its first evaluation batch: a preemption
during the evaluation.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

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
    rank = int(
        os.environ.get("RANK")
        or os.environ.get("SLURM_PROCID")
        or os.environ.get("PMI_RANK")
        or "0"
    )  # srun, mpiexec: no RANK yet
    log = open(os.path.join(spec["log_dir"], f"{rank}.txt"), "a")

    hold = spec.get("hold")  # issue 30: {"rank", "step", "dir"}: wait there for the test
    trainer: Trainer

    def step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: the step is also the eval step
            if spec.get("signal_in_eval") and not trainer.preempt_requested:
                os.kill(os.getpid(), signal.SIGUSR1)
            return (model(batch / 100.0) ** 2).mean()
        if spec.get("fail_step") == trainer.global_step + 1:
            raise ValueError("the same error on every rank")
        if hold and rank == hold["rank"] and trainer.global_step == hold["step"]:
            released = os.path.join(hold["dir"], "released")
            if not os.path.exists(released):  # only the first attempt holds
                with open(os.path.join(hold["dir"], "ready.tmp"), "w") as fh:
                    fh.write(str(os.getpid()))
                os.replace(
                    os.path.join(hold["dir"], "ready.tmp"), os.path.join(hold["dir"], "ready")
                )
                deadline = time.monotonic() + 120  # only against a test that never acts
                while not os.path.exists(released) and time.monotonic() < deadline:
                    time.sleep(0.01)  # the test stops or kills this rank here
        ids = " ".join(str(int(v)) for v in batch.flatten().tolist())
        if hold:  # the step too: a step trained again after a resume is told apart
            log.write(f"{current['epoch']} {trainer.global_step + 1} {ids}\n")
        else:
            log.write(f"{current['epoch']} {ids}\n")
        log.flush()
        return (model(batch / 100.0) ** 2).mean()

    torch.manual_seed(0)
    eval_data = Indices(spec["eval_n"]) if spec.get("eval_n") else None
    trainer = Trainer(
        nn.Linear(1, 1),
        Indices(spec["n"]),
        TrainConfig.from_dict(spec["config"]),
        step,
        eval_data,
    )
    trainer.fit()
    ddp.shutdown()


if __name__ == "__main__":
    main()
