"""Reading a config: the YAML file, dotted ``--set`` assignments, and the seed's spellings.

``--set section.key=value`` values are parsed as YAML (so lists and null work); a
config file is strict YAML (:mod:`ddp.yaml_io`). Seed 004's configs spell some keys
their own way: they are accepted as aliases (:data:`ALIASES`), each noted once, and a
file that sets ``optim.lr`` without naming ``scaling.rule`` holds final values
(:func:`final_unless_scaled`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp import yaml_io
from ddp.config_check import _scalar
from ddp.errors import ConfigError


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
            raise ConfigError(
                f"{alias}: {value!r} and {canonical}: {node[ckey]!r} disagree; "
                f"allowed: one of the two ({alias} is the seed's name for "
                f"{canonical})"
            )
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
                raise ConfigError(
                    f"model.{alias}: {value!r} and model.{canonical}: "
                    f"{given[canonical]!r} disagree; allowed: one of the two "
                    f"(model.{alias} is the seed's name for model.{canonical})"
                )
            out[canonical] = value
            _note(
                f"model.{alias} is the seed's name for model.{canonical}; using model.{canonical}"
            )
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
        _note(
            f"{where} sets optim.lr/warmup without scaling.rule: its values are final "
            "(scaling.rule: none); name a rule in the file to have them scaled"
        )
    return raw
