"""The sections of :class:`ddp.config.TrainConfig`, one dataclass each.

Each key is declared once, here: its type and default, and through :func:`key` its
bounds, choices and help (:mod:`ddp.config_schema`). The coercion every value passes and
the one generic check that reads these declarations are :mod:`ddp.config_check`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ddp.config_schema import key
from hpc_ddp.run_layout import CHECKPOINTS

# What the numbers may be beyond their meaning: what the libraries they reach can hold.
# A value past these would pass the range checks and fail later as an OverflowError or a
# C++ type error from torch, after the process group exists.
MAX_SECONDS = 365 * 86400.0
"""Every duration in seconds (timeouts, grace): one year. ``timedelta`` holds 1e14 s,
C++'s milliseconds 9e15 ms, ``threading``'s waits 9e9 s; none means anything near."""
FLOAT32_MAX = 3.4028234663852886e38
"""Learning rates: torch's optimizers compute with them in float32 tensors."""
MAX_BATCH = 2**31 - 1
"""Per-rank batch size and accumulation: their product with the world size is a sample
count that Python's ``islice`` and the samplers take as a C ``ssize_t``."""
MAX_BUCKET_MB = 1e12
"""DDP's gradient bucket: torch turns it into an int64 number of bytes."""
SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGCONT", "SIGXCPU")
"""The signals ``preemption.signals`` may name."""
_LR = {"gt": 0, "most": FLOAT32_MAX, "note": "(float32)"}


@dataclass
class TrainingConfig:
    """Loop length and data order. ``batch_size`` is per rank and per micro-step."""

    batch_size: int = key(32, ge=1, le=MAX_BATCH, help="samples per rank and micro-step")
    accum: int = key(1, ge=1, le=MAX_BATCH, help="micro-steps per optimizer step")
    epochs: int = key(1, ge=0)
    max_steps: int | None = key(None, ge=1, help="optimizer steps over the run; null: no limit")
    max_samples: int | None = key(None, ge=1, help="use only the first N training samples")
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    eval_every_n_epochs: int = key(1, help="0: evaluate only at the end")


@dataclass
class OptimConfig:
    name: str = key("adamw", choices=("adamw", "sgd"))
    lr: float = key(1e-3, **_LR)
    weight_decay: float = key(0.0, ge=0)
    momentum: float = key(0.0, ge=0, help="sgd only")
    betas: list[float] = key(factory=lambda: [0.9, 0.999], length=2, ge=0, lt=1, help="adamw only")
    warmup_steps: int = key(0, ge=0)
    schedule: str = key("constant", choices=("constant", "linear", "cosine"))
    min_lr_ratio: float = key(
        0.0,
        ge=0,
        le=1,
        noun="a fraction of optim.lr",
        help="floor of linear/cosine decay as a fraction of lr",
    )
    grad_clip: float | None = key(None, ge=0, help="max global grad norm; null or 0: off")


@dataclass
class ScalingConfig:
    """How LR (and optionally warmup) follow the world size: ``none|linear|sqrt|cap:N``.

    ``cap:N`` caps the factor ``world / base_world_size`` at N (see :mod:`ddp.scaling`).
    ``by: batch`` scales by ``effective batch / base_batch_size`` instead (the seeds'
    formula); ``base_batch_size`` is then required (0 = unset).
    """

    # rule and base_batch_size are checked by ddp.config_check._check_scaling (a grammar,
    # and a rule that ties base_batch_size to by): their help says what it allows.
    rule: str = key("none", help="none, linear, sqrt or cap:N with N >= 1")
    base_world_size: int = key(1, ge=1)
    scale_warmup: bool = False
    by: str = key("world", choices=("world", "batch"))
    base_batch_size: int = key(
        0, help="the effective batch the base lr was tuned for: >= 1 with by: batch, else 0"
    )


@dataclass
class MemoryConfig:
    gradient_checkpointing: bool = False
    max_memory_fraction: float | None = key(None, gt=0, le=1, help="cuda/xpu per-process cap")


@dataclass
class DDPConfig:
    """Options handed to DistributedDataParallel, plus how the process group starts."""

    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    bucket_cap_mb: float = key(25.0, gt=0, most=MAX_BUCKET_MB)
    backend: str = key("auto", help="auto, nccl, gloo, xccl, ccl, mpi or xpu (ddp.backends)")
    device: str = key("auto", help="auto (the first available), cuda, xpu, mps or cpu")
    # Collective timeout. None: $DDP_TIMEOUT, else $NCCL_TIMEOUT (seconds, the seeds'
    # advice), else 1800 s; the value in effect is logged. Precedence, highest first:
    # ddp.init(timeout=...) in a script > this key (config file, --set) > DDP_TIMEOUT
    # > NCCL_TIMEOUT.
    timeout_s: float | None = key(
        None,
        gt=0,
        most=MAX_SECONDS,
        noun="seconds",
        note="(a year)",
        help="collective timeout; null: $DDP_TIMEOUT, else $NCCL_TIMEOUT, else 1800",
    )
    # ddp: a full replica per rank. fsdp: FSDP2 shards parameters, gradients and optimizer
    # state over the ranks (ddp.fsdp); the options below apply to fsdp only.
    strategy: str = key("ddp", choices=("ddp", "fsdp"))
    fsdp_blocks: list[str] | None = key(
        None, help="fsdp: a class name or module names to shard by; null: the layer stacks"
    )
    reshard_after_forward: bool = True
    fsdp_mixed_precision: str = key("none", choices=("none", "bf16"))
    cpu_offload: bool = False
    activation_checkpointing: bool = False


@dataclass
class DataConfig:
    num_workers: int = key(0, ge=0)
    pin_memory: bool = False


@dataclass
class BestConfig:
    """``checkpoint.best``: keep ``<checkpoint.dir>/best/model.pt`` (final/'s export
    format) whenever this evaluation metric improves (seed 002's ``best_model.pt``)."""

    metric: str | None = key(None, help="null: off; eval/loss (or eval_loss), eval/acc, ...")
    mode: str = key("min", choices=("min", "max"))


@dataclass
class CheckpointConfig:
    # None = no checkpoints, no export. A relative path is taken from $HPC_RUN_DIR when
    # `hpc submit` started the job (so a requeued job resumes from its own run directory),
    # else from the working directory. An absolute path is kept as it is.
    dir: str | None = key(CHECKPOINTS, help="null: none; relative: under $HPC_RUN_DIR if set")
    every_n_steps: int = key(0, ge=0, help="0: only at the end of each epoch")
    # Also a checkpoint once every_s seconds have passed since the last one (0 = off): the
    # sites' rule ("checkpoint every 15 minutes": every_s: 900, ALCF Aurora). Rank 0's clock
    # decides; the decision rides in the preemption vote, so all ranks save at one step.
    every_s: float = key(
        0.0, ge=0, le=MAX_SECONDS, allowed=f"seconds from 0 (off) to {MAX_SECONDS:.0f} (a year)"
    )
    keep_last: int = key(2, ge=1)
    resume: str = key("auto", ok=bool, allowed="auto, none or a checkpoint path")
    save_final: bool = True
    best: BestConfig = field(default_factory=BestConfig)  # {metric: eval/loss, mode: min}

    def __post_init__(self) -> None:
        run_dir = os.environ.get("HPC_RUN_DIR")
        if self.dir and run_dir and not os.path.isabs(self.dir):
            self.dir = os.path.join(os.path.abspath(run_dir), self.dir)


@dataclass
class WandbConfig:
    project: str | None = key(None, help="null: W&B off")
    mode: str = key("offline", choices=("offline", "online", "disabled"))
    # The run's name in W&B (seed 002's wandb.init(name=args.run_name)); None: the
    # recipe's --run-name (recipe.run_name) if it has one, else W&B's generated name.
    name: str | None = None
    # wandb.Settings(init_timeout=...): seconds wandb.init may take. Seed 002's fix for
    # multi-node jobs whose rank 0 reaches W&B slowly (its default, 90 s, was too short).
    init_timeout: float = key(120.0, gt=0, most=MAX_SECONDS, noun="seconds")


@dataclass
class LoggingConfig:
    every_n_steps: int = key(50, ge=1)
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: str = key("auto", choices=("auto", "bar", "plain", "off"))
    # metrics.jsonl (one line per log point and evaluation, rank 0). "auto": in the run
    # directory `hpc submit` made ($HPC_RUN_DIR), else in checkpoint.dir; a path; or null.
    metrics_file: str | None = key("auto", help="metrics.jsonl: auto, a path or null")
    # RUN/env-JOBID.json beside metrics.jsonl at start: packages, torch/CUDA/NCCL/oneCCL
    # versions, modules, git commit + diff, NCCL_*/CCL_*/FI_* variables (never a name like
    # a secret), and the nodes whose software differs (ddp.fingerprint; hpc report diffs it).
    fingerprint: bool = True
    # Per-rank timing (ddp.stragglers): each rank's data wait, forward and backward+step
    # host seconds ride the log point's all-reduce (no added collective or sync). A rank
    # whose data or forward time is over straggler_factor x the median, and at least
    # straggler_min_s a step above it, at straggler_points log points in a row is
    # reported once (a warning, RUN/ranks.jsonl; hpc report's heat map). 0: off.
    straggler_factor: float = key(
        1.5,
        ok=lambda v: v == 0 or 1 < v <= 1e6,
        allowed="a number > 1 (at most 1e6), or 0 (off)",
    )
    straggler_points: int = key(3, ge=1, le=1_000_000)
    straggler_min_s: float = key(0.005, ge=0, le=MAX_SECONDS, allowed="seconds >= 0")


@dataclass
class PreemptionConfig:
    signals: list[str] = key(
        factory=lambda: ["SIGUSR1", "SIGTERM"], items=SIGNALS, noun="signal names"
    )
    # true: rank 0 runs `scontrol requeue $SLURM_JOB_ID` after the preemption checkpoint;
    # DDP_REQUEUE=1 (exported by `hpc render` for a spec with `requeue: true`) does the same.
    # An array task requeues ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID} only; a requeue
    # SLURM refuses submits the next segment instead (ddp.preemption.requeue).
    requeue: bool = key(False, help="requeue the SLURM job after a preemption checkpoint")
    # Ranks agree on the flag with one tiny CPU all_reduce (ddp.preemption.Vote), at most
    # every check_every_n_steps steps and about every check_interval_s seconds: the steps
    # between votes follow the step time measured at log points, the same on every rank.
    # A signal is acted on within about two intervals. check_interval_s 0: every step.
    check_every_n_steps: int = key(1, ge=1)
    check_interval_s: float = key(0.25, ge=0, le=10, noun="seconds")
    # After SIGTERM a rank that has not finished within grace_s seconds (or whose main
    # thread does not respond within 5 s: stuck in a collective) prints its stacks and
    # exits 143 (ddp.preemption). Below torchrun's and SLURM's 30 s kill delay; 0 = off.
    grace_s: float = key(
        20.0,
        ge=0,
        le=MAX_SECONDS,
        allowed=f"seconds from 0 (no watchdog) to {MAX_SECONDS:.0f} (a year)",
    )


@dataclass
class PhaseConfig:
    """One stage of a multi-stage run (seed 000): its own epochs, LR and sample cap.

    Unset fields fall back to ``training``/``optim``. Each phase starts a fresh
    optimizer and schedule.
    """

    name: str | None = None
    epochs: int | None = key(None, ge=0, say_null=False)
    lr: float | None = key(None, **_LR, say_null=False)
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

    sample_frequency: int = key(0, ge=0)
    num_samples: int = key(8, ge=1)
    sample_steps: int = key(128, ge=1)
    predictor: str = key("analytic", choices=("analytic", "euler"))
    log_gradients: bool = False
    log_weights: bool = False
