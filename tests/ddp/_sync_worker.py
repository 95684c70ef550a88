"""One rank of a Trainer run that counts host reads of tensors in its steady state.

Counting starts when the step function sees global step ``start`` and stops when it sees
``stop`` (argv: JSON spec with out, start, stop, and the config). In between, every way a
tensor's value reaches Python is counted: ``aten::_local_scalar_dense`` (``.item()``,
``bool()``, ``float()``, ``int()``) through a dispatch mode, and ``tolist``, ``numpy``,
``cpu`` and ``item`` through patched methods. On a GPU each of those makes the host wait
for the device. The preemption vote's own CPU buffers are reported apart (``vote_reads``):
they never live on a device, which the record shows too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ddp._train_worker import make_data, make_model


class Reads(TorchDispatchMode):
    """Counts host reads of tensor values, apart from the ``exempt`` tensors."""

    def __init__(self, exempt: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.exempt = {id(t) for t in exempt}
        self.count = 0
        self.exempt_count = 0
        self.where: list[str] = []

    def note(self, t: torch.Tensor, what: str) -> None:
        if id(t) in self.exempt:
            self.exempt_count += 1
            return
        self.count += 1
        import traceback

        self.where.append(what + " " + "".join(traceback.format_stack(limit=6)[:-2]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.note(args[0], "item/bool/float/int")
        return func(*args, **(kwargs or {}))


def main() -> None:
    spec = json.loads(sys.argv[1])
    import ddp
    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    cfg = TrainConfig.from_dict(spec["config"])
    state: dict = {"mode": None}
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

    def patched(name: str):
        def read(self, *a, **k):
            mode = state["mode"]
            if mode is not None:
                mode.note(self, name)
            return originals[name](self, *a, **k)

        return read

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if trainer.global_step == spec["start"] and state["mode"] is None:
            state["mode"] = Reads(trainer._vote.buffers)
            for name in originals:
                setattr(torch.Tensor, name, patched(name))
            state["mode"].__enter__()
        elif trainer.global_step == spec["stop"] and state["mode"] is not None:
            state["mode"].__exit__(None, None, None)
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
            state["done"], state["mode"] = state["mode"], None
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    trainer = Trainer(make_model(), make_data(spec["n"]), cfg, step)
    trainer.fit()
    done = state["done"]
    record = {
        "rank": ddp.get_context().rank,
        "reads": done.count,
        "where": done.where[:5],
        "vote_reads": done.exempt_count,
        "vote_on_cpu": all(b.device.type == "cpu" for b in trainer._vote.buffers),
    }
    Path(spec["out"], f"rank{record['rank']}.json").write_text(json.dumps(record))
    ddp.shutdown()


if __name__ == "__main__":
    main()
