"""The sections of :class:`ddp.config.TrainConfig`, one dataclass each.

Each key is a typed field with its default (and, for a choice, its ``choices``); the
coercion and the range checks every value passes are :mod:`ddp.config_check`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class TrainingConfig:
    """Loop length and data order. ``batch_size`` is per rank and per micro-step."""

    batch_size: int = 32
    accum: int = 1
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps over the whole run; None = no limit
    max_samples: int | None = None  # use only the first N training samples
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    eval_every_n_epochs: int = 1  # 0 = evaluate only at the end


@dataclass
class OptimConfig:
    name: str = field(default="adamw", metadata={"choices": ("adamw", "sgd")})
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw only
    warmup_steps: int = 0
    schedule: str = field(
        default="constant", metadata={"choices": ("constant", "linear", "cosine")}
    )
    min_lr_ratio: float = 0.0  # floor of linear/cosine decay as a fraction of lr
    grad_clip: float | None = None  # max global grad norm; None or 0 = off


@dataclass
class ScalingConfig:
    """How LR (and optionally warmup) follow the world size: ``none|linear|sqrt|cap:N``.

    ``cap:N`` caps the factor ``world / base_world_size`` at N (see :mod:`ddp.scaling`).
    ``by: batch`` scales by ``effective batch / base_batch_size`` instead (the seeds'
    formula); ``base_batch_size`` is then required (0 = unset).
    """

    rule: str = "none"
    base_world_size: int = 1
    scale_warmup: bool = False
    by: str = field(default="world", metadata={"choices": ("world", "batch")})
    base_batch_size: int = 0


@dataclass
class MemoryConfig:
    gradient_checkpointing: bool = False
    max_memory_fraction: float | None = None  # cuda/xpu per-process cap, (0, 1]


@dataclass
class DDPConfig:
    """Options handed to DistributedDataParallel, plus how the process group starts."""

    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    bucket_cap_mb: float = 25.0
    backend: str = "auto"  # auto | nccl | gloo | xccl | ccl | mpi | xpu (see ddp.backends)
    device: str = "auto"  # auto | cuda | xpu | mps | cpu (auto: the first available)
    # Collective timeout. None: $DDP_TIMEOUT, else $NCCL_TIMEOUT (seconds, the seeds'
    # advice), else 1800 s; the value in effect is logged. Precedence, highest first:
    # ddp.init(timeout=...) in a script > this key (config file, --set) > DDP_TIMEOUT
    # > NCCL_TIMEOUT.
    timeout_s: float | None = None
    # ddp: a full replica per rank. fsdp: FSDP2 shards parameters, gradients and optimizer
    # state over the ranks (ddp.fsdp); the options below apply to fsdp only.
    strategy: str = field(default="ddp", metadata={"choices": ("ddp", "fsdp")})
    fsdp_blocks: list[str] | None = None  # class name or module names; None: layer stacks
    reshard_after_forward: bool = True
    fsdp_mixed_precision: str = field(default="none", metadata={"choices": ("none", "bf16")})
    cpu_offload: bool = False
    activation_checkpointing: bool = False


@dataclass
class DataConfig:
    num_workers: int = 0
    pin_memory: bool = False


@dataclass
class BestConfig:
    """``checkpoint.best``: keep ``<checkpoint.dir>/best/model.pt`` (final/'s export
    format) whenever this evaluation metric improves (seed 002's ``best_model.pt``)."""

    metric: str | None = None  # None: off. eval/loss (or eval_loss), eval/acc, ...
    mode: str = field(default="min", metadata={"choices": ("min", "max")})


@dataclass
class CheckpointConfig:
    # None = no checkpoints, no export. A relative path is taken from $HPC_RUN_DIR when
    # `hpc submit` started the job (so a requeued job resumes from its own run directory),
    # else from the working directory. An absolute path is kept as it is.
    dir: str | None = "checkpoints"
    every_n_steps: int = 0  # 0 = only at the end of each epoch
    # Also a checkpoint once every_s seconds have passed since the last one (0 = off): the
    # sites' rule ("checkpoint every 15 minutes": every_s: 900, ALCF Aurora). Rank 0's clock
    # decides; the decision rides in the preemption vote, so all ranks save at one step.
    every_s: float = 0.0
    keep_last: int = 2
    resume: str = "auto"  # auto | none | PATH
    save_final: bool = True
    best: BestConfig = field(default_factory=BestConfig)  # {metric: eval/loss, mode: min}

    def __post_init__(self) -> None:
        run_dir = os.environ.get("HPC_RUN_DIR")
        if self.dir and run_dir and not os.path.isabs(self.dir):
            self.dir = os.path.join(os.path.abspath(run_dir), self.dir)


@dataclass
class WandbConfig:
    project: str | None = None  # None = W&B off
    mode: str = field(default="offline", metadata={"choices": ("offline", "online", "disabled")})
    # The run's name in W&B (seed 002's wandb.init(name=args.run_name)); None: the
    # recipe's --run-name (recipe.run_name) if it has one, else W&B's generated name.
    name: str | None = None
    # wandb.Settings(init_timeout=...): seconds wandb.init may take. Seed 002's fix for
    # multi-node jobs whose rank 0 reaches W&B slowly (its default, 90 s, was too short).
    init_timeout: float = 120.0


@dataclass
class LoggingConfig:
    every_n_steps: int = 50
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: str = field(default="auto", metadata={"choices": ("auto", "bar", "plain", "off")})
    # metrics.jsonl (one line per log point and evaluation, rank 0). "auto": in the run
    # directory `hpc submit` made ($HPC_RUN_DIR), else in checkpoint.dir; a path; or null.
    metrics_file: str | None = "auto"
    # RUN/env-JOBID.json beside metrics.jsonl at start: packages, torch/CUDA/NCCL/oneCCL
    # versions, modules, git commit + diff, NCCL_*/CCL_*/FI_* variables (never a name like
    # a secret), and the nodes whose software differs (ddp.fingerprint; hpc report diffs it).
    fingerprint: bool = True
    # Per-rank timing (ddp.stragglers): each rank's data wait, forward and backward+step
    # host seconds ride the log point's all-reduce (no added collective or sync). A rank
    # whose data or forward time is over straggler_factor x the median, and at least
    # straggler_min_s a step above it, at straggler_points log points in a row is
    # reported once (a warning, RUN/ranks.jsonl; hpc report's heat map). 0: off.
    straggler_factor: float = 1.5
    straggler_points: int = 3
    straggler_min_s: float = 0.005


@dataclass
class PreemptionConfig:
    signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    # true: rank 0 runs `scontrol requeue $SLURM_JOB_ID` after the preemption checkpoint;
    # DDP_REQUEUE=1 (exported by `hpc render` for a spec with `requeue: true`) does the same.
    # An array task requeues ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID} only; a requeue
    # SLURM refuses submits the next segment instead (ddp.preemption.requeue).
    requeue: bool = False
    # Ranks agree on the flag with one tiny CPU all_reduce (ddp.preemption.Vote), at most
    # every check_every_n_steps steps and about every check_interval_s seconds: the steps
    # between votes follow the step time measured at log points, the same on every rank.
    # A signal is acted on within about two intervals. check_interval_s 0: every step.
    check_every_n_steps: int = 1
    check_interval_s: float = 0.25
    # After SIGTERM a rank that has not finished within grace_s seconds (or whose main
    # thread does not respond within 5 s: stuck in a collective) prints its stacks and
    # exits 143 (ddp.preemption). Below torchrun's and SLURM's 30 s kill delay; 0 = off.
    grace_s: float = 20.0


@dataclass
class PhaseConfig:
    """One stage of a multi-stage run (seed 000): its own epochs, LR and sample cap.

    Unset fields fall back to ``training``/``optim``. Each phase starts a fresh
    optimizer and schedule.
    """

    name: str | None = None
    epochs: int | None = None
    lr: float | None = None
    max_samples: int | None = None
    skip: bool = False


@dataclass
class MonitoringConfig:
    """Seed 004's ``monitoring:`` section.

    ``sample_frequency``: every that many optimizer steps a recipe that can sample
    (uniref50's diffusion model) has rank 0 write ``num_samples`` sequences, drawn in
    ``sample_steps`` reverse steps with ``predictor``, to ``samples/step_N.fasta``; 0 = never.
    ``log_gradients``/``log_weights``: per-layer gradient and weight L2 norms at log
    points (computed on the device at the log step only, read with the log point's
    other numbers: no extra host synchronisation between log points).
    """

    sample_frequency: int = 0
    num_samples: int = 8
    sample_steps: int = 128
    predictor: str = field(default="analytic", metadata={"choices": ("analytic", "euler")})
    log_gradients: bool = False
    log_weights: bool = False
