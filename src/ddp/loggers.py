"""Where the trainer's numbers go: the console (a progress bar or plain lines),
``metrics.jsonl``, TensorBoard and W&B, behind one small interface.

Only rank 0 logs; the other ranks get an empty :class:`Loggers`. A writer whose package
is missing is skipped with a warning, never a failure: the run matters more than its plots.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from ddp.config import TrainConfig
from hpc_ddp.run_layout import METRICS

log = logging.getLogger("ddp")


class Writer(Protocol):
    """A metrics sink: scalars by name at a global step."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class MetricsFile:
    """``metrics.jsonl``: one JSON object per log point (``"kind": "train"``) and per
    evaluation (``"eval"``), flushed at once so a running job's file can be read.

    A resumed run first drops the lines past the step it resumes from (it logs those
    steps again), so the file never holds a step twice. Lines a killed run left half
    written are dropped the same way.
    """

    def __init__(self, path: Path, resume_step: int) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            kept = []
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                    if rec["step"] <= resume_step:
                        kept.append(line)
            from ddp.checkpoint import atomic_write_text

            atomic_write_text("".join(k + "\n" for k in kept), path)
        self._fh = open(path, "a", encoding="utf-8")

    def write(self, kind: str, step: int, epoch: int | None, metrics: dict[str, float]) -> None:
        rec = {"kind": kind, "step": step, "epoch": epoch, "time": round(time.time(), 3)}
        rec.update({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        self._fh.write(json.dumps(rec, allow_nan=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def metrics_path(config: TrainConfig) -> Path | None:
    """Where ``logging.metrics_file`` puts metrics.jsonl (None: nowhere)."""
    choice = config.logging.metrics_file
    if choice is None or choice == "":
        return None
    if choice != "auto":
        return Path(choice)
    run_dir = os.environ.get("HPC_RUN_DIR")
    if run_dir:
        return Path(run_dir) / METRICS
    if config.checkpoint.dir:
        return Path(config.checkpoint.dir) / METRICS
    return None


class Loggers:
    """The console plus every configured writer, for one rank (empty off rank 0)."""

    def __init__(self, config: TrainConfig, main: bool, world_size: int | None = None) -> None:
        self.config = config
        self.main = main
        self.run_info = run_info(config, _world(world_size))
        self.writers: list[Writer] = open_writers(config, self.run_info) if main else []
        self._bar: _Progress | None = None
        self._metrics: MetricsFile | None = None
        self.last: dict[str, float] = {}
        self._epoch = 0  # the last train record's epoch: the final evaluation's epoch

    def open_metrics(self, resume_step: int) -> None:
        """Start metrics.jsonl (rank 0), keeping what a resumed run already logged."""
        path = metrics_path(self.config)
        if self.main and path is not None:
            self._metrics = MetricsFile(path, resume_step)
            # The first record (and one per restart): what the scaling made of the config.
            self._metrics.write("run", resume_step, None, self.run_info)

    def start_phase(self, name: str, total: int, done: int) -> None:
        """A progress bar (or plain lines) for ``total`` optimizer steps, ``done`` already."""
        self.end_phase()
        self._bar = _Progress(self.main, self.config.logging.progress, total, name)
        self._bar.advance_to(done)

    def end_phase(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def train(self, metrics: dict[str, float], step: int, phase_step: int, epoch: int) -> None:
        """A log point's rank-averaged metrics (every rank calls; rank 0 reports)."""
        self.last = metrics
        self._epoch = epoch
        if not self.main:
            return
        if self._bar is not None:
            self._bar.update(phase_step, metrics)
            if self._bar.plain:
                log.info(
                    "step %d epoch %d %s",
                    step,
                    epoch + 1,
                    " ".join(f"{k}={fmt(v)}" for k, v in metrics.items()),
                )
        self._emit({f"train/{k}": v for k, v in metrics.items()}, step, epoch)
        if self._metrics is not None:
            self._metrics.write("train", step, epoch, metrics)

    def eval(self, metrics: dict[str, float], step: int, epoch: int | None = None) -> None:
        if not self.main:
            return
        if epoch is not None:
            log.info("epoch %d %s", epoch + 1, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        self._emit(metrics, step, self._epoch if epoch is None else epoch)
        if self._metrics is not None:
            self._metrics.write("eval", step, epoch, metrics)

    def samples(self, metrics: dict[str, float], step: int) -> None:
        """Statistics of sequences a recipe sampled (rank 0): the writers and metrics.jsonl."""
        if not self.main:
            return
        self._emit({f"samples/{k}": v for k, v in metrics.items()}, step, self._epoch)
        if self._metrics is not None:
            self._metrics.write("samples", step, self._epoch, metrics)

    def close(self, exit_code: int = 0) -> None:
        """Flush and close every writer (W&B: ``wandb.finish(exit_code=...)``). The
        Trainer calls this on every way out of rank 0: success (0), a failure (1, also
        right before :func:`ddp.parts.die` ends the process without ``finally``), and a
        preemption (75: the W&B run is marked preempting, so a requeue can resume it)."""
        self.end_phase()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        for w in self.writers:
            try:
                if isinstance(w, WandB):
                    w.close(exit_code)
                else:
                    w.close()
            except Exception as exc:  # a writer's flush must not hide the run's result
                log.warning("closing %s failed: %s", type(w).__name__, exc)
        self.writers = []

    def _emit(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        """Every writer gets the record with its ``epoch`` (0-based, as in metrics.jsonl
        and the seed's ``wandb.log({"train/loss": ..., "epoch": epoch})``)."""
        record = {**metrics, "epoch": epoch}
        for w in self.writers:
            w.log(record, step)


def open_writers(config: TrainConfig, info: dict[str, float] | None = None) -> list[Writer]:
    """TensorBoard (``<checkpoint.dir>/tensorboard``) and W&B, as configured."""
    out: list[Writer] = []
    lg = config.logging
    if lg.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter

            logdir = os.path.join(config.checkpoint.dir or ".", "tensorboard")
            out.append(TensorBoard(SummaryWriter(logdir)))
        except ImportError:
            log.warning("logging.tensorboard: tensorboard is not installed; skipping")
    if lg.wandb.project and lg.wandb.mode != "disabled":
        run = open_wandb(config, info)
        if run is not None:
            out.append(WandB(run))
    return out


def wandb_name(config: TrainConfig) -> str | None:
    """``logging.wandb.name``, else the recipe's ``--run-name`` (``recipe.run_name``,
    seed 002's flag), else None (W&B generates one)."""
    name = config.logging.wandb.name or config.recipe.get("run_name") or None
    return str(name) if name is not None else None


def open_wandb(config: TrainConfig, info: dict[str, float] | None = None) -> Any:
    """``wandb.init`` as seed 002 calls it (rank 0 only: the caller), or None.

    A missing package or an init that fails (no network within ``init_timeout``, a bad
    key) is one warning and the run goes on without W&B: the run matters more than its
    plots, and a multi-node job must not die on rank 0 while its peers wait."""
    w = config.logging.wandb
    try:
        import wandb
    except ImportError:
        log.warning("logging.wandb: wandb is not installed (pip install hpc-ddp[wandb]); skipping")
        return None
    try:
        return wandb.init(
            project=w.project,
            name=wandb_name(config),
            # one of logging.wandb.mode's choices, checked with the config
            mode=cast(Literal["offline", "online", "disabled"], w.mode),
            config={**config.to_dict(), **(info or {})},
            settings=wandb.Settings(init_timeout=w.init_timeout),
        )
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning(
            "logging.wandb: wandb.init failed (%s); training goes on without W&B "
            "(logging.wandb.init_timeout is %gs)",
            first,
            w.init_timeout,
        )
        return None


class TensorBoard:
    def __init__(self, writer: Any) -> None:
        self.w = writer

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class WandB:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, exit_code: int = 0) -> None:
        from ddp.preemption import PREEMPTED_EXIT_CODE

        if exit_code == PREEMPTED_EXIT_CODE:
            self.run.mark_preempting()
        self.run.finish(exit_code=exit_code)


class _Progress:
    """Rank-0 progress: a rich bar on a TTY, plain log lines otherwise."""

    def __init__(self, main: bool, mode: str, total: int, name: str) -> None:
        self.bar = None
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "plain"
        self.plain = main and mode == "plain"
        if main and mode == "bar":
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[sps]} samples/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self.bar.start()
            self.task = self.bar.add_task(name, total=total, loss="-", sps="-")

    def advance_to(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.update(
                self.task,
                completed=step,
                loss=f"{metrics['loss']:.4f}",
                sps=f"{metrics['samples_per_s']:.0f}",
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ---- the run's scaled values, and per-layer norms (issue 26) --------------------------------
def _world(world_size: int | None) -> int:
    if world_size is not None:
        return world_size
    import ddp

    ctx = ddp.get_context()
    return ctx.world_size if ctx is not None else 1


def run_info(config: TrainConfig, world_size: int) -> dict[str, float]:
    """Seed 004's ``ddp/*`` values: what the scaling rule made of the config at this world
    size. In the W&B config and in metrics.jsonl's first record, so a run's plots say the
    learning rate it really used (the config alone holds the base value)."""
    return {
        "ddp/world_size": world_size,
        "ddp/effective_batch_size": config.effective_batch(world_size),
        "ddp/scaled_lr": config.scaled_lr(world_size),
        "ddp/scaled_warmup": config.scaled_warmup(world_size),
    }


def layer_of(name: str) -> str:
    """A parameter's layer: its name up to the first list index (``blocks.3``), else its
    first component (``embed``); DDP's and compile's wrappers' prefixes dropped."""
    parts = [p for p in name.split(".") if p not in ("module", "_orig_mod", "_fsdp_wrapped_module")]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else name


def layer_sq_norms(model: Any, grads: bool) -> tuple[list[str], Any]:
    """(layer names, squared L2 norms per layer on the device) of the gradients or weights.

    Stays on the device (no host synchronisation): the trainer reads it with the log
    point's other numbers. FSDP shards are their local parts (the caller sums ranks).
    """
    import torch

    groups: dict[str, list[Any]] = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        groups.setdefault(layer_of(name), []).append(t)
    names = sorted(groups)
    if not names:
        return [], None
    sq = [
        torch.stack([n.float() ** 2 for n in torch._foreach_norm(groups[k])]).sum() for k in names
    ]
    return names, torch.stack(sq)
