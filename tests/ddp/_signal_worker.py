"""One rank of a Trainer run that hangs or evaluates slowly on request (JSON spec, argv[1]).

Spec keys: config (TrainConfig mapping), n, eval_n, ready_dir (each rank writes
<rank>.pid there when it reaches the point the test signals), and one of
hang_rank/hang_step (that rank sleeps in Python at that step while its peers block in
the next collective; a peer writes <rank>.backward from its last Python code of that step,
the hook on its input's gradient: the trainer registers no Python hook or comm hook, so
what runs after it, up to the gradient all-reduce's wait, is native code), nan_step (the loss is NaN from that step on) or slow_eval (each eval batch takes this many seconds; the pid
file is written at the first one). out: rank 0 saves the final weights there.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

from tests.ddp._train_worker import make_data, make_model


def _ready(spec: dict, rank: int, suffix: str = "pid") -> None:
    path = os.path.join(spec["ready_dir"], f"{rank}.{suffix}")
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(path + ".tmp", path)


def main() -> None:
    spec = json.loads(sys.argv[1])
    import ddp
    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    trainer: Trainer

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rank = ddp.get_context().rank
        if spec.get("hang_step") == trainer.global_step:
            _ready(spec, rank)
            if rank == spec.get("hang_rank"):
                time.sleep(600)  # a hung rank; its peers wait in the gradient all-reduce
        x, y = batch
        if spec.get("hang_step") == trainer.global_step and rank != spec.get("hang_rank"):
            x = x.clone().requires_grad_(True)
            x.register_hook(lambda grad: _ready(spec, rank, "backward"))
        loss = nn.functional.mse_loss(model(x), y)
        if spec.get("nan_step") is not None and trainer.global_step >= spec["nan_step"]:
            loss = loss * float("nan")  # a diverging run
        return loss

    def evaluate(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if spec.get("slow_eval"):
            _ready(spec, ddp.get_context().rank)
            time.sleep(spec["slow_eval"])
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    cfg = TrainConfig.from_dict(spec["config"])
    eval_data = make_data(spec["eval_n"], seed=1) if spec.get("eval_n") else None
    trainer = Trainer(make_model(), make_data(spec.get("n", 64)), cfg, step, eval_data, evaluate)
    trainer.fit()
    if ddp.get_context().is_main and spec.get("out"):
        torch.save(trainer.model.state_dict(), spec["out"])
    ddp.shutdown()


if __name__ == "__main__":
    main()
