"""TrainConfig: YAML sections, dotted ``--set`` overrides, validation and LR scaling rules.

Every key is a typed dataclass field, so a value from YAML, from ``--set
section.key=value`` or from a recipe flag goes through the same coercion and
validation, and a typo stops the run before any process group exists with one
line that names the key and the nearest valid one.

Two sections are free-form: ``model:`` and ``recipe:`` hold recipe-specific
keys. Their allowed keys and types come from the recipe's defaults
(:func:`check_free_section`), so they get the same typo protection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from ddp import scaling, yaml_io
from ddp.errors import ConfigError

_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGCONT", "SIGXCPU")

# What the numbers may be beyond their meaning: what the libraries they reach can hold.
# A value past these would pass the range checks below and fail later as an
# OverflowError or a C++ type error from torch, after the process group exists.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
"""Every integer field: a 64-bit integer (torch's seeds, sizes and counts are int64)."""
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
    schedule: str = field(default="constant", metadata={"choices": ("constant", "linear", "cosine")})
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


SWEEP_PATHS = {
    "checkpoint.dir": "a later task would resume an earlier one's checkpoint and train 0 steps",
    "logging.metrics_file": "every task would append its metrics to one file",
}
"""Paths a sweep task must keep to itself, and what sharing one would do."""


def check_sweep_paths(cfg: TrainConfig, environ: typing.Mapping[str, str] | None = None) -> None:
    """A sweep task keeps its checkpoints and its metrics in a folder of its own.

    ``hpc submit --sweep`` runs each task with ``HPC_SWEEP_INDEX`` set, its own folder
    as ``HPC_RUN_DIR`` and the keys its overrides set in ``HPC_SWEEP_KEYS``. A
    ``checkpoint.dir`` (or an explicit ``logging.metrics_file``) outside that folder which
    the sweep did not set per task is the same path for every task: a later task would
    resume an earlier one's checkpoint, train 0 steps and end COMPLETED. hpc refuses
    ``--set checkpoint.dir=`` at submit; a recipe flag (``--output_dir``) or a
    ``--config`` file only shows here. A relative metrics file is taken from the job's
    working directory, the same for every task, so it is refused too.
    """
    env = os.environ if environ is None else environ
    run_dir = env.get("HPC_RUN_DIR")
    if env.get("HPC_SWEEP_INDEX") is None or not run_dir:
        return
    swept = env.get("HPC_SWEEP_KEYS", "").split(",")
    metrics = cfg.logging.metrics_file
    for key, path in (("checkpoint.dir", cfg.checkpoint.dir),
                      ("logging.metrics_file", None if metrics == "auto" else metrics)):
        if not path or key in swept:  # swept: hpc checked at submit that each task gets its own
            continue
        task, target = os.path.realpath(run_dir), os.path.realpath(path)
        if os.path.commonpath([task, target]) != task:
            raise ConfigError(
                f"{key}: {path!r} is outside this sweep task's folder {run_dir!r}, so every "
                f"task would share it ({SWEEP_PATHS[key]}); allowed: no {key} (each task "
                f"keeps its own), one inside the task's folder, or a --sweep of {key} with "
                "one per task"
            )


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
class TrainConfig:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    precision: str = field(default="fp32", metadata={"choices": ("fp32", "bf16", "fp16")})
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    phases: list[PhaseConfig] = field(default_factory=list)
    monitoring: MonitoringConfig = field(default_factory=lambda: MonitoringConfig())
    model: dict[str, Any] = field(default_factory=dict)  # free: checked by the recipe
    recipe: dict[str, Any] = field(default_factory=dict)  # free: checked by the recipe

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> TrainConfig:
        """Build and validate from a nested mapping (parsed YAML)."""
        return _build(cls, data or {}, "")

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        """Load a YAML file; a missing file or bad YAML is a ConfigError."""
        return cls.from_dict(read_yaml(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ---- overrides ----------------------------------------------------------------
    def override(self, assignments: list[str] | tuple[str, ...]) -> TrainConfig:
        """Return a new config with ``section.key=value`` strings applied, validated."""
        data = self.to_dict()
        for item in assignments:
            key, value = parse_assignment(item)
            key, value = alias_assignment(key, value)
            _set_dotted(data, key, value)
        return TrainConfig.from_dict(data)

    def with_values(self, values: dict[str, Any]) -> TrainConfig:
        """Return a new config with already-typed dotted keys applied (recipe flags)."""
        data = self.to_dict()
        for key, value in values.items():
            _set_dotted(data, key, value)
        return TrainConfig.from_dict(data)

    # ---- derived values -----------------------------------------------------------
    # The arithmetic is ddp.scaling's, the same that `hpc scale` prints.
    def scale_factor(self, world_size: int) -> float:
        sc = self.scaling
        if sc.by == "world":
            return scale_factor(sc.rule, world_size, sc.base_world_size)
        try:
            return scaling.factor_by(sc.rule, sc.by, world_size,
                                     effective=self.effective_batch(world_size),
                                     base_batch_size=sc.base_batch_size)  # fmt: skip
        except scaling.ScalingRuleError as exc:
            raise ConfigError(f"scaling: {exc}") from None

    def scaled_lr(self, world_size: int, lr: float | None = None) -> float:
        base = self.optim.lr if lr is None else lr
        return scaling.scaled_lr(base, self.scale_factor(world_size))

    def scaled_warmup(self, world_size: int) -> int:
        if not self.scaling.scale_warmup:
            return self.optim.warmup_steps
        return scaling.scaled_warmup(self.optim.warmup_steps, self.scale_factor(world_size))

    def effective_batch(self, world_size: int) -> int:
        t = self.training
        return scaling.effective_batch(t.batch_size, t.accum, world_size)


# ---- scaling rules -------------------------------------------------------------------
def scale_factor(rule: str, world_size: int, base_world_size: int = 1) -> float:
    """LR multiplier for ``world_size`` ranks relative to ``base_world_size``.

    ``linear``: w/b; ``sqrt``: sqrt(w/b); ``cap:N``: min(w/b, N), N >= 1; ``none``: 1.
    One implementation for the trainer and ``hpc scale``: :mod:`ddp.scaling`.
    """
    try:
        return scaling.scale_factor(rule, world_size, base_world_size)
    except scaling.ScalingRuleError as exc:
        raise ConfigError(f"scaling.rule: {exc}") from None


# ---- parsing helpers -----------------------------------------------------------------
def parse_assignment(item: str) -> tuple[str, Any]:
    """Split ``a.b=value``; the value is parsed as YAML (so lists and null work)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml_io.loads(raw, f"--set {key}") if raw.strip() else ""
    except ConfigError as exc:
        if "not valid YAML" not in str(exc):
            raise  # duplicate keys, alias bombs: refused, not taken as a string
        value = raw
    return key, value


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's raw mapping (strict YAML, see :mod:`ddp.yaml_io`)."""
    data = yaml_io.load_file(path)
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    return final_unless_scaled(apply_aliases(data or {}), str(path))


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: no such list element")
            node = node[int(part)]
            continue
        if part not in node:
            _unknown(".".join(parts[:i]), part, list(node))
        if node[part] is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict | list):
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"{key}: no such list element")
        node[int(last)] = value
        return
    if last not in node and not _is_free(parts[:-1]):
        _unknown(".".join(parts[:-1]), last, list(node))
    node[last] = value


def _is_free(path: list[str]) -> bool:
    return bool(path) and path[0] in ("model", "recipe")


def _unknown(where: str, key: str, valid: list[str]) -> typing.NoReturn:
    name = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    near = f"{where}.{close[0]}" if close and where else (close[0] if close else "")
    hint = f"; did you mean {near!r}?" if close else ""
    raise ConfigError(f"unknown key {name!r}{hint} (valid: {', '.join(valid)})")


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            _unknown(where, str(key), list(fields))
        path = f"{where}.{key}" if where else str(key)
        kwargs[key] = _coerce(value, hints[key], path, fields[key].metadata.get("choices"))
    obj = cls(**kwargs)
    _validate(obj, where)
    return obj


def _coerce(value: Any, tp: Any, path: str, choices: tuple[str, ...] | None = None) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise ConfigError naming ``path``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        return _coerce(value, args[0], path, choices)
    if dataclasses.is_dataclass(tp):
        return _build(tp, {} if value is None else value, path)
    if origin is list:
        (item_tp,) = get_args(tp)
        if value is None:
            return []
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{path}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if choices is not None and isinstance(value, bool) and ("off" if not value else "on") in choices:
        value = "on" if value else "off"  # YAML 1.1 reads a bare off/on as a boolean
    out = _scalar(value, tp, path)
    if choices is not None and out not in choices:
        close = difflib.get_close_matches(str(out), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path}: {out!r} is not one of {', '.join(choices)}{hint}")
    return out


def _scalar(value: Any, tp: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return _int64(value, value, path)
        if isinstance(value, float) and value.is_integer():
            return _int64(int(value), value, path)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                f = math.nan
            if f.is_integer():
                return _int64(int(f), value, path)
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        out: float | None = None
        if isinstance(value, int | float):
            out = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            with contextlib.suppress(ValueError):
                out = float(value)
        if out is None:
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        # No field means anything by NaN or inf, and NaN passes every `x <= 0` check
        # below: refused here, once, for every float.
        if not math.isfinite(out):
            raise ConfigError(f"{path}: {value!r} is not a finite number; allowed: a real number")
        return out
    if tp is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise ConfigError(f"{path}: unsupported type {tp!r}")  # pragma: no cover


def _int64(out: int, value: Any, path: str) -> int:
    """``out`` if it is a 64-bit integer (:data:`INT_MIN`..:data:`INT_MAX`), else one line:
    every integer field goes through here, so ``1e300`` never reaches torch."""
    if not INT_MIN <= out <= INT_MAX:
        raise ConfigError(f"{path}: {value!r} is out of range; allowed: an integer from "
                          f"{INT_MIN} to {INT_MAX}")  # fmt: skip
    return out


def _validate(obj: Any, where: str) -> None:
    """Range checks that the type alone cannot express."""

    def bad(key: str, value: Any, allowed: str) -> typing.NoReturn:
        name = f"{where}.{key}" if where else key
        raise ConfigError(f"{name}: {value!r} is not allowed; expected {allowed}")

    if isinstance(obj, TrainingConfig):
        for k in ("batch_size", "accum"):
            if not 1 <= getattr(obj, k) <= MAX_BATCH:
                bad(k, getattr(obj, k), f"an integer from 1 to {MAX_BATCH}")
        if obj.epochs < 0:
            bad("epochs", obj.epochs, "an integer >= 0")
        for k in ("max_steps", "max_samples"):
            v = getattr(obj, k)
            if v is not None and v < 1:
                bad(k, v, "an integer >= 1 or null")
    elif isinstance(obj, OptimConfig):
        if not 0 < obj.lr <= FLOAT32_MAX:
            bad("lr", obj.lr, f"a number > 0 and at most {FLOAT32_MAX:.4g} (float32)")
        if obj.weight_decay < 0:
            bad("weight_decay", obj.weight_decay, "a number >= 0")
        if obj.momentum < 0:
            bad("momentum", obj.momentum, "a number >= 0")
        if not 0 <= obj.min_lr_ratio <= 1:
            bad("min_lr_ratio", obj.min_lr_ratio, "a fraction of optim.lr in [0, 1]")
        if obj.warmup_steps < 0:
            bad("warmup_steps", obj.warmup_steps, "an integer >= 0")
        if obj.grad_clip is not None and obj.grad_clip < 0:
            bad("grad_clip", obj.grad_clip, "a number >= 0 or null")
        if len(obj.betas) != 2 or not all(0 <= b < 1 for b in obj.betas):
            bad("betas", obj.betas, "two numbers in [0, 1)")
    elif isinstance(obj, ScalingConfig):
        if obj.base_world_size < 1:
            bad("base_world_size", obj.base_world_size, "an integer >= 1")
        if obj.base_batch_size < 0 or (obj.by == "batch" and obj.base_batch_size < 1):
            bad("base_batch_size", obj.base_batch_size,
                "an integer >= 1 (the effective batch the base lr was tuned for) with by: batch")
        if obj.by == "world" and obj.base_batch_size:
            bad("base_batch_size", obj.base_batch_size, "0 with by: world (set by: batch to use it)")
        try:
            scaling.parse_rule(obj.rule)
        except scaling.ScalingRuleError:
            close = difflib.get_close_matches(obj.rule, list(scaling.RULES), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            bad("rule", obj.rule, f"none, linear, sqrt or cap:N with N >= 1{hint}")
    elif isinstance(obj, MemoryConfig):
        f = obj.max_memory_fraction
        if f is not None and not 0 < f <= 1:
            bad("max_memory_fraction", f, "a number in (0, 1] or null")
    elif isinstance(obj, DDPConfig):
        if not 0 < obj.bucket_cap_mb <= MAX_BUCKET_MB:
            bad("bucket_cap_mb", obj.bucket_cap_mb, f"a number > 0 and at most {MAX_BUCKET_MB:g}")
        if obj.timeout_s is not None and not 0 < obj.timeout_s <= MAX_SECONDS:
            bad("timeout_s", obj.timeout_s,
                f"seconds > 0 and at most {MAX_SECONDS:.0f} (a year), or null")
    elif isinstance(obj, DataConfig):
        if obj.num_workers < 0:
            bad("num_workers", obj.num_workers, "an integer >= 0")
    elif isinstance(obj, CheckpointConfig):
        if obj.every_n_steps < 0:
            bad("every_n_steps", obj.every_n_steps, "an integer >= 0")
        if not 0 <= obj.every_s <= MAX_SECONDS:
            bad("every_s", obj.every_s, f"seconds from 0 (off) to {MAX_SECONDS:.0f} (a year)")
        if obj.keep_last < 1:
            bad("keep_last", obj.keep_last, "an integer >= 1")
        if not obj.resume:
            bad("resume", obj.resume, "auto, none or a checkpoint path")
    elif isinstance(obj, LoggingConfig):
        if obj.every_n_steps < 1:
            bad("every_n_steps", obj.every_n_steps, "an integer >= 1")
        if not (obj.straggler_factor == 0 or 1 < obj.straggler_factor <= 1e6):
            bad("straggler_factor", obj.straggler_factor, "a number > 1 (at most 1e6), or 0 (off)")
        if not 1 <= obj.straggler_points <= 1_000_000:
            bad("straggler_points", obj.straggler_points, "an integer from 1 to 1000000")
        if not 0 <= obj.straggler_min_s <= MAX_SECONDS:
            bad("straggler_min_s", obj.straggler_min_s, "seconds >= 0")
    elif isinstance(obj, WandbConfig):
        if not 0 < obj.init_timeout <= MAX_SECONDS:
            bad("init_timeout", obj.init_timeout, f"seconds > 0 and at most {MAX_SECONDS:.0f}")
    elif isinstance(obj, PreemptionConfig):
        for s in obj.signals:
            if s not in _SIGNALS:
                close = difflib.get_close_matches(s, _SIGNALS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                bad("signals", s, f"signal names among {', '.join(_SIGNALS)}{hint}")
        if obj.check_every_n_steps < 1:
            bad("check_every_n_steps", obj.check_every_n_steps, "an integer >= 1")
        if not 0 <= obj.check_interval_s <= 10:
            bad("check_interval_s", obj.check_interval_s, "seconds in [0, 10]")
        if not 0 <= obj.grace_s <= MAX_SECONDS:
            bad("grace_s", obj.grace_s,
                f"seconds from 0 (no watchdog) to {MAX_SECONDS:.0f} (a year)")
    elif isinstance(obj, MonitoringConfig):
        for k, low in (("sample_frequency", 0), ("num_samples", 1), ("sample_steps", 1)):
            if getattr(obj, k) < low:
                bad(k, getattr(obj, k), f"an integer >= {low}")
    elif isinstance(obj, PhaseConfig):
        if obj.epochs is not None and obj.epochs < 0:
            bad("epochs", obj.epochs, "an integer >= 0")
        if obj.lr is not None and not 0 < obj.lr <= FLOAT32_MAX:
            bad("lr", obj.lr, f"a number > 0 and at most {FLOAT32_MAX:.4g} (float32)")


def check_free_section(
    config: TrainConfig, section: str, defaults: dict[str, Any]
) -> dict[str, Any]:
    """Merge a free section (``model``/``recipe``) over a recipe's defaults, typed by them.

    Each default's Python type is the key's type (``None`` defaults accept anything),
    so recipe keys get the same unknown-key and bad-value errors as built-in ones.
    The merged values are written back into ``config`` so the resolved YAML shows them.
    """
    given = free_aliases(section, getattr(config, section), defaults)
    merged = dict(defaults)
    for key, value in given.items():
        if key not in defaults:
            _unknown(section, key, list(defaults))
        default = defaults[key]
        tp: Any = Any if default is None else type(default)
        if isinstance(default, list):
            tp = list[Any]
        elif isinstance(default, dict):
            tp = dict[str, Any]
        elif default is not None:
            tp = tp | None if value is None else tp
        merged[key] = _coerce(value, tp, f"{section}.{key}")
    setattr(config, section, merged)
    return merged


# ---- seed 004's configs as written (issue 26): aliases, monitoring, final LR ----------------
# The seed guide's YAML spells five keys its own way; they are accepted as aliases of
# the keys above, each noted once (logged by the Trainer on rank 0 through
# log_config_notes, once logging exists) with the key it stands for. A file that gives
# both spellings with different values is refused: which one was meant is unknowable.
ALIASES: dict[str, str] = {
    "optim.warmup": "optim.warmup_steps",
    "memory.max_memory_per_gpu": "memory.max_memory_fraction",
    "training.num_workers": "data.num_workers",
    "memory.mixed_precision": "precision",  # true -> bf16 (AMP without a GradScaler), false -> fp32
}
#: Aliases inside the free ``model:`` section, applied when the recipe has the canonical
#: key and not the alias (so a recipe whose own key is ``hidden_size`` keeps it).
MODEL_ALIASES: dict[str, str] = {"hidden_size": "d_model"}
_NOTES: dict[str, None] = {}  # pending notes, in order, without repeats
_LOGGED: set[str] = set()


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


def _note(text: str) -> None:
    if text not in _LOGGED:
        _NOTES.setdefault(text)


def log_config_notes() -> None:
    """Log each pending note once per process (rank 0's INFO; other ranks stay quiet)."""
    import logging

    for text in list(_NOTES):
        if text not in _LOGGED:
            logging.getLogger("ddp").info("config: %s", text)
            _LOGGED.add(text)
    _NOTES.clear()


def _alias_value(alias: str, value: Any) -> Any:
    if alias != "memory.mixed_precision":
        return value
    flag = _scalar(value, bool, alias)
    return "bf16" if flag else "fp32"


def alias_assignment(key: str, value: Any) -> tuple[str, Any]:
    """``--set`` with an alias: the canonical key and value (noted once)."""
    if key in ALIASES:
        _note(f"{key} is the seed's name for {ALIASES[key]}; using {ALIASES[key]}")
        return ALIASES[key], _alias_value(key, value)
    return key, value


def apply_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """A config file's mapping with every alias moved to its canonical key."""
    for alias, canonical in ALIASES.items():
        sec, key = alias.split(".")
        section = raw.get(sec)
        if not isinstance(section, dict) or key not in section:
            continue
        value = _alias_value(alias, section.pop(key))
        if not section:
            raw.pop(sec)
        *csec, ckey = canonical.split(".")
        node = raw
        for part in csec:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{part}: expected a mapping, got {node!r}")
        if ckey in node and node[ckey] != value:
            raise ConfigError(f"{alias}: {value!r} and {canonical}: {node[ckey]!r} disagree; "
                              f"allowed: one of the two ({alias} is the seed's name for "
                              f"{canonical})")  # fmt: skip
        node[ckey] = value
        _note(f"{alias} is the seed's name for {canonical}; using {canonical}")
    return raw


def free_aliases(section: str, given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``model.hidden_size`` as ``model.d_model`` where the recipe has d_model only."""
    if section != "model":
        return given
    out = dict(given)
    for alias, canonical in MODEL_ALIASES.items():
        if alias in out and alias not in defaults and canonical in defaults:
            value = out.pop(alias)
            other = given.get(canonical, defaults[canonical])  # the file's, else the default
            if other not in (value, defaults[canonical]):
                raise ConfigError(f"model.{alias}: {value!r} and model.{canonical}: "
                                  f"{given[canonical]!r} disagree; allowed: one of the two "
                                  f"(model.{alias} is the seed's name for model.{canonical})")
            out[canonical] = value
            _note(f"model.{alias} is the seed's name for model.{canonical}; "
                  f"using model.{canonical}")
    return out


def final_unless_scaled(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The one scaling rule: a config file that sets ``optim.lr`` or ``optim.warmup_steps``
    (or its alias ``optim.warmup``) without naming ``scaling.rule`` holds final values, for
    the world size it is run at: ``scaling.rule: none`` is set, so nothing is scaled twice.

    Seed 004's per-GPU-count configs hold values already multiplied by the GPU count
    (2 GPUs: lr 1e-4, warmup 10000); a recipe's default rule would scale them again. A
    file that names ``scaling.rule`` (as configs/uniref50.yaml does: ``linear``) gives
    base values for ``scaling.base_world_size`` ranks, scaled by that rule.
    """
    optim, scale = raw.get("optim"), raw.get("scaling")
    sets = isinstance(optim, dict) and ("lr" in optim or "warmup_steps" in optim)
    named = isinstance(scale, dict) and "rule" in scale
    if sets and not named:
        if scale is None:
            raw["scaling"] = {}
        if not isinstance(raw["scaling"], dict):
            raise ConfigError(f"scaling: expected a mapping, got {raw['scaling']!r}")
        raw["scaling"]["rule"] = "none"
        _note(f"{where} sets optim.lr/warmup without scaling.rule: its values are final "
              "(scaling.rule: none); name a rule in the file to have them scaled")
    return raw
