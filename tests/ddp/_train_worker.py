"""One rank of a small, deterministic Trainer run, driven by a JSON spec (argv[1]).

Spec keys: config (TrainConfig mapping), n (train samples), eval_n, dropout,
out (rank 0 saves {"state", "summary"} there), summary (rank 0 writes the summary's
numbers there as JSON), fail_rank/fail_step (raise there), fail_write_rank (that
rank's sharded checkpoint writes fail with ENOSPC),
wait_signal_step + ready_dir (write <rank>.pid at that step, then spin until a
preemption signal arrives, at most wait_timeout seconds (30), so a test can signal
every rank mid-epoch), hold_file (the wait for a signal also ends once this file exists),
clock_per_step (the Trainer's clock reads global_step times this many seconds; a list:
one per rank), slow_rank + slow_data_s (that rank's data loader takes that many seconds
more per sample: a straggler in the data phase).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g))


def make_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))


def main() -> None:
    spec = json.loads(sys.argv[1])
    import ddp
    from ddp.config import TrainConfig
    from ddp.trainer import Trainer

    cfg = TrainConfig.from_dict(spec["config"])
    trainer: Trainer
    if spec.get("fail_write_rank") is not None:
        _fail_shard_writes(int(spec["fail_write_rank"]))

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rank = ddp.get_context().rank
        if rank == spec.get("fail_rank") and trainer.global_step + 1 == spec.get("fail_step"):
            raise RuntimeError("injected failure")
        if spec.get("wait_signal_step") == trainer.global_step and not trainer.preempt_requested:
            path = os.path.join(spec["ready_dir"], f"{rank}.pid")
            with open(path + ".tmp", "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            deadline = time.monotonic() + spec.get("wait_timeout", 30)
            hold = spec.get("hold_file")  # or until this file exists (then no signal came)
            while (
                not trainer.preempt_requested
                and time.monotonic() < deadline
                and not (hold and os.path.exists(hold))
            ):
                time.sleep(0.01)  # the test process sends the signal; this rank only idles
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    eval_data = make_data(spec["eval_n"], seed=1) if spec.get("eval_n") else None
    data = make_data(spec.get("n", 64))
    if spec.get("slow_rank") is not None and int(os.environ["RANK"]) == spec["slow_rank"]:
        data = _Slow(data, float(spec["slow_data_s"]))
    trainer = Trainer(make_model(spec.get("dropout", 0.0)), data, cfg, step, eval_data)
    if spec.get("clock_per_step"):  # checkpoint.every_s tests: time advances by steps
        per_rank = spec["clock_per_step"]
        tick = float(per_rank[int(os.environ["RANK"])] if isinstance(per_rank, list) else per_rank)
        trainer.clock = lambda: trainer.global_step * tick
    summary = trainer.fit()
    if ddp.get_context().is_main and spec.get("summary"):
        with open(spec["summary"], "w") as fh:
            json.dump({k: v for k, v in summary.items() if isinstance(v, int | float)}, fh)
    if ddp.get_context().is_main and spec.get("out"):
        torch.save({"state": trainer.model.state_dict(), "summary": summary}, spec["out"])
    ddp.shutdown()


class _Slow(torch.utils.data.Dataset):
    """The dataset with ``delay`` seconds more per sample (a slow disk on one node)."""

    def __init__(self, data: TensorDataset, delay: float) -> None:
        self.data, self.delay = data, delay

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)  # the injected slowness itself, not a wait on an event
        return self.data[i]


def _fail_shard_writes(rank: int) -> None:
    """On ``rank``, DCP's file writer fails as on a full disk (in its background thread)."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        import ddp

        if ddp.get_context().rank == rank:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
