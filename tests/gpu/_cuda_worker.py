"""One rank of a small Trainer run on CUDA, driven by a JSON spec (argv[1]); writes a
JSON report (spec["report"]) and the final weights (spec["out"]) for tests/gpu.

The model and data are the CPU tests' (tests/ddp/_train_worker.py), so a GPU result
reads against the same run on the CPU. Spec keys: config, n, eval_n, dropout, out, report,
loss_mult (multiplies the loss: large values make fp16 gradients overflow at
GradScaler's initial scale, so the scaler's state differs from its defaults),
probe_alloc_gb (after fit, try to allocate this much: max_memory_fraction's check),
nccl_group (a real 1-rank NCCL process group, and ddp's helpers told to use it: every
collective the Trainer issues on the default group then runs through NCCL, which
refuses CPU tensors; one GPU cannot hold two NCCL ranks).
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from tests.ddp._train_worker import make_data, make_model


class RecordingScaler(torch.amp.GradScaler):
    """GradScaler that remembers the state it was restored to, so a test can compare it
    with the checkpoint's (a resume that dropped the scaler's state shows here)."""

    instances: list[RecordingScaler] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loaded: dict | None = None
        RecordingScaler.instances.append(self)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.loaded = dict(self.state_dict())


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.amp.GradScaler = RecordingScaler  # the Trainer builds its scaler through this name
    import ddp
    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    if spec.get("nccl_group"):
        import torch.distributed as tdist

        tdist.init_process_group(
            "nccl", init_method="env://", rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
        ddp.dist._distributed = lambda: True  # world 1 skips collectives; here they run
    cfg = TrainConfig.from_dict(spec["config"])
    losses: list[torch.Tensor] = []
    seen: dict[str, str] = {}
    mult = float(spec.get("loss_mult", 1.0))

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        seen.setdefault("out_dtype", str(out.dtype))
        seen.setdefault("batch_device", str(x.device))
        loss = nn.functional.mse_loss(out, y) * mult
        losses.append(loss.detach().float())  # stays on the device: no sync per step
        return loss

    eval_data = make_data(spec["eval_n"], seed=1) if spec.get("eval_n") else None
    trainer = Trainer(
        make_model(spec.get("dropout", 0.0)), make_data(spec.get("n", 64)), cfg, step, eval_data
    )
    summary = trainer.fit()
    ctx = ddp.get_context()
    report = {
        "device": str(ctx.device),
        "backend": ctx.backend,
        "world": ctx.world_size,
        "wrapped": type(trainer.wrapped).__name__,
        "param_device": str(next(trainer.model.parameters()).device),
        "losses": torch.stack(losses).cpu().tolist() if losses else [],
        "summary": {k: v for k, v in summary.items() if isinstance(v, int | float)},
        "last_metrics": trainer.last_metrics,
        **seen,
        "scalers": [
            {"loaded": s.loaded, "final": dict(s.state_dict())} for s in RecordingScaler.instances
        ],
    }
    if spec.get("probe_alloc_gb"):
        try:
            block = torch.empty(
                int(spec["probe_alloc_gb"] * 2**30), dtype=torch.uint8, device=ctx.device
            )
            del block
            report["probe"] = "allocated"
        except torch.OutOfMemoryError:
            report["probe"] = "oom"
    if spec.get("out"):
        torch.save({k: v.cpu() for k, v in trainer.model.state_dict().items()}, spec["out"])
    with open(spec["report"], "w") as fh:
        json.dump(report, fh)
    ddp.shutdown()


if __name__ == "__main__":
    main()
