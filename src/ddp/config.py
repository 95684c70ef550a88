"""TrainConfig: YAML sections, dotted ``--set`` overrides, validation and LR scaling rules.

Every key is a typed dataclass field, so a value from YAML, from ``--set
section.key=value`` or from a recipe flag goes through the same coercion and
validation, and a typo stops the run before any process group exists with one
line that names the key and the nearest valid one.

Two sections are free-form: ``model:`` and ``recipe:`` hold recipe-specific
keys. Their allowed keys and types come from the recipe's defaults
(:func:`check_free_section`), so they get the same typo protection.

This module is :class:`TrainConfig` itself; its parts: :mod:`ddp.config_sections` (one
dataclass per section, each key declared once: type, default, bounds, choices, help),
:mod:`ddp.config_schema` (what a declaration holds, and the one check and message made
from it), :mod:`ddp.config_check` (coercion to each field's type, and the section checks),
:mod:`ddp.config_set` (dotted ``--set`` on a built config), :mod:`ddp.config_load` (the
YAML file, parsing ``--set``, the seed's key aliases and final-LR rule).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddp import config_schema, config_set, scaling

# MAX_SECONDS (ddp.dist), log_config_notes (ddp.trainer) and the section types other than
# TrainConfig's own imports are imported from ddp.config, as before the split: offered here.
from ddp.config_check import (
    MAX_SECONDS,  # noqa: F401
    _build,
    _coerce,
    _unknown,
)
from ddp.config_load import (
    alias_assignment,
    free_aliases,
    log_config_notes,  # noqa: F401
    parse_assignment,
    read_yaml,
)
from ddp.config_sections import (
    BestConfig,  # noqa: F401
    CheckpointConfig,
    DataConfig,
    DDPConfig,
    LoggingConfig,
    MemoryConfig,
    MonitoringConfig,
    OptimConfig,
    PhaseConfig,
    PreemptionConfig,
    ScalingConfig,
    TrainingConfig,
    WandbConfig,  # noqa: F401
)
from ddp.errors import ConfigError

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
    for key, path in (
        ("checkpoint.dir", cfg.checkpoint.dir),
        ("logging.metrics_file", None if metrics == "auto" else metrics),
    ):
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
class TrainConfig:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    precision: str = config_schema.key("fp32", choices=("fp32", "bf16", "fp16"))
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
    # Both set the keys on a copy and check what they touched (ddp.config_set): the
    # config is not taken apart into a dict and built again, once per call.
    def override(self, assignments: list[str] | tuple[str, ...]) -> TrainConfig:
        """Return a new config with ``section.key=value`` strings applied, validated."""
        out = copy.deepcopy(self)
        config_set.apply(out, (alias_assignment(*parse_assignment(item)) for item in assignments))
        return out

    def with_values(self, values: dict[str, Any]) -> TrainConfig:
        """Return a new config with already-typed dotted keys applied (recipe flags)."""
        out = copy.deepcopy(self)
        config_set.apply(out, values.items())
        return out

    # ---- derived values -----------------------------------------------------------
    # The arithmetic is ddp.scaling's, the same that `hpc scale` prints.
    def scale_factor(self, world_size: int) -> float:
        sc = self.scaling
        if sc.by == "world":
            return scale_factor(sc.rule, world_size, sc.base_world_size)
        try:
            return scaling.factor_by(
                sc.rule,
                sc.by,
                world_size,
                effective=self.effective_batch(world_size),
                base_batch_size=sc.base_batch_size,
            )
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
