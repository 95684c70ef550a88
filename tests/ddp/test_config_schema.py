"""Each config key declared once (ddp.config_schema): the declaration drives the check and
its one-line message, and ``--set`` changes a built config without building it again."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

import pytest

from ddp import config_set, recipes
from ddp.config import TrainConfig
from ddp.config_check import _build
from ddp.config_schema import check_value, declared, describe, key, phrase
from ddp.config_sections import OptimConfig
from ddp.errors import ConfigError


@dataclass
class _Toy:
    """A section of its own: nothing in it is in ddp.config_sections."""

    count: int = key(3, ge=2, le=5)
    wait: float | None = key(None, gt=0, most=60.0, noun="seconds", note="(a minute)")
    ratio: float = key(0.5, ge=0, lt=1)
    pick: str = key("alpha", choices=("alpha", "beta"))
    names: list[str] = key(factory=list, items=("SIGA", "SIGB"), noun="signal names")
    pair: list[float] = key(factory=lambda: [1.0, 2.0], length=2, ge=0)
    free: int = 0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"count": 7}, "toy.count: 7 is not allowed; expected an integer from 2 to 5"),
        ({"count": 1}, "toy.count: 1 is not allowed; expected an integer from 2 to 5"),
        (
            {"wait": 61},
            "toy.wait: 61.0 is not allowed; expected seconds > 0 and at most 60 (a minute), "
            "or null",
        ),
        ({"ratio": 1}, "toy.ratio: 1.0 is not allowed; expected a number in [0, 1)"),
        ({"pick": "alpah"}, "toy.pick: 'alpah' is not one of alpha, beta; did you mean 'alpha'?"),
        (
            {"names": ["SIGA", "SIGAX"]},
            "toy.names: 'SIGAX' is not allowed; expected signal names among SIGA, SIGB; "
            "did you mean 'SIGA'?",
        ),
        (
            {"pair": [1, 2, 3]},
            "toy.pair: [1.0, 2.0, 3.0] is not allowed; expected two numbers >= 0",
        ),
        ({"pair": [1, -2]}, "toy.pair: [1.0, -2.0] is not allowed; expected two numbers >= 0"),
    ],
)
def test_a_declared_bound_or_choice_is_the_check_and_its_message(
    data: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        _build(_Toy, data, "toy")
    assert str(exc.value) == message


def test_the_bounds_themselves_pass_and_an_undeclared_key_is_its_type_only() -> None:
    toy = _build(_Toy, {"count": 5, "wait": 60, "ratio": 0, "names": ["SIGB"], "free": -9}, "")
    assert (toy.count, toy.wait, toy.ratio, toy.names, toy.free) == (5, 60.0, 0.0, ["SIGB"], -9)
    assert _build(_Toy, {"wait": None}, "").wait is None


def test_an_unknown_key_names_the_nearest_declared_one() -> None:
    with pytest.raises(ConfigError) as exc:
        _build(_Toy, {"cuont": 3}, "toy")
    valid = ", ".join(f.name for f in dataclasses.fields(_Toy))
    assert str(exc.value) == f"unknown key 'toy.cuont'; did you mean 'toy.count'? (valid: {valid})"
    with pytest.raises(ConfigError) as exc:
        TrainConfig().override(["optim.warmup_step=5"])
    valid = ", ".join(f.name for f in dataclasses.fields(OptimConfig))
    assert str(exc.value) == (
        f"unknown key 'optim.warmup_step'; did you mean 'optim.warmup_steps'? (valid: {valid})"
    )


def _declared_numbers() -> list[tuple[str, type, Any]]:
    """(dotted key, section, declaration) of every bounded number in TrainConfig."""
    out: list[tuple[str, type, Any]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
            if typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
                walk(typing.get_args(tp)[0], f"{prefix}{f.name}.0.")
            elif dataclasses.is_dataclass(args[0]):
                walk(args[0], f"{prefix}{f.name}.")
            elif typing.get_origin(tp) is list:
                continue  # betas, signals: the toy section above
            elif (d := declared(f)) is not None and args[0] in (int, float) and d.ok is None:
                if any(b is not None for b in (d.ge, d.gt, d.le, d.lt, d.most)):
                    out.append((f"{prefix}{f.name}", cls, d))

    walk(TrainConfig, "")
    return out


@pytest.mark.parametrize(("dotted", "cls", "decl"), _declared_numbers())
def test_every_declared_bound_of_the_config_is_enforced_at_its_edge(
    dotted: str, cls: type, decl: Any
) -> None:
    """Walks the declarations, not a list of keys: a key declared later is covered."""
    base = TrainConfig.from_dict({"phases": [{"name": "one"}]})
    tp = typing.get_type_hints(cls)[dotted.rsplit(".", 1)[1]]
    for edge, inside in ((decl.ge, True), (decl.gt, False), (decl.le, True), (decl.lt, False)):
        if edge is None or (edge > 1e9 and inside):
            continue
        step = 1 if int in typing.get_args(tp) or tp is int else 1e-6 * max(1.0, abs(edge))
        past = edge - step if edge in (decl.ge, decl.gt) else edge + step
        if inside:
            assert check_value(decl, edge, tp) is None
            assert base.override([f"{dotted}={edge}"]) is not base
        with pytest.raises(ConfigError) as exc:
            base.override([f"{dotted}={past!r}"])
        assert str(exc.value).startswith(f"{dotted}: ")
        assert str(exc.value).endswith(f"is not allowed; expected {phrase(decl, tp)}")


# ---- --set: set once, check what changed -----------------------------------------------
def _count_builds(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """Constructions of TrainConfig and its sections; section checks run by --set."""
    built: list[str] = []
    checked: list[str] = []
    for cls in (TrainConfig, OptimConfig):
        real_init = cls.__init__

        def init(self: Any, *a: Any, _real: Any = real_init, **kw: Any) -> None:
            built.append(type(self).__name__)
            _real(self, *a, **kw)

        monkeypatch.setattr(cls, "__init__", init)
    real_validate = config_set._validate

    def validate(obj: Any, where: str) -> None:
        checked.append(where or "<root>")
        real_validate(obj, where)

    monkeypatch.setattr(config_set, "_validate", validate)
    return built, checked


def test_set_builds_nothing_and_checks_each_touched_section_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = TrainConfig()
    built, checked = _count_builds(monkeypatch)
    cfg = base.override(["optim.lr=2e-3", "optim.weight_decay=0.1", "training.epochs=3"])
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.training.epochs) == (2e-3, 0.1, 3)
    assert built == []  # no TrainConfig or section constructed again
    assert sorted(checked) == ["optim", "training"]
    assert base.optim.lr == 1e-3  # the original is not changed
    assert cfg.with_values({"optim.lr": 5e-4}).optim.lr == 5e-4 and built == []


def test_resolve_builds_the_config_once_with_flags_and_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built, _ = _count_builds(monkeypatch)
    cfg = recipes.resolve(
        recipes.get("dpo"), None, ["optim.lr=2e-3", "training.max_steps=7"], {"num_epochs": 4}
    )
    assert (cfg.optim.lr, cfg.training.max_steps, cfg.training.epochs) == (2e-3, 7, 4)
    assert built.count("TrainConfig") == 1


def test_sets_are_checked_together_after_all_are_applied() -> None:
    """The second key makes the first valid; a bad value later replaced is not an error."""
    cfg = TrainConfig().override(["scaling.by=batch", "scaling.base_batch_size=64"])
    assert (cfg.scaling.by, cfg.scaling.base_batch_size) == ("batch", 64)
    assert TrainConfig().override(["optim.lr=-1", "optim.lr=0.5"]).optim.lr == 0.5
    cfg = TrainConfig.from_dict({"phases": [{"name": "a"}]})
    assert cfg.override(["phases.0.skip=maybe", "phases=[]"]).phases == []


def test_a_key_inside_a_list_value_is_one_line() -> None:
    """Was a TypeError traceback ('float' is not iterable) from the dict walk."""
    with pytest.raises(ConfigError, match=r"^optim\.betas\.0 is a value, not a section$"):
        TrainConfig().override(["optim.betas.0.x=1"])


# ---- the reference a user reads is the declaration ---------------------------------------
def test_describe_says_what_the_error_would_say() -> None:
    lines = describe(_Toy)
    assert lines[0] == "count: 3  # an integer from 2 to 5"
    assert lines[1] == "wait: null  # seconds > 0 and at most 60 (a minute), or null"
    assert lines[3] == 'pick: "alpha"  # one of alpha, beta'
    assert lines[-1] == "free: 0  # an integer"
    with pytest.raises(ConfigError) as exc:
        _build(_Toy, {"count": 9}, "")
    assert str(exc.value).endswith(lines[0].split("# ", 1)[1])


def test_python_m_ddp_keys_lists_every_key_with_its_range_and_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ddp.__main__ import main

    assert main(["--keys"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        "optim.lr: 0.001  # a number > 0 and at most 3.403e+38 (float32)" in out
        and "phases.N.skip: false  # true or false" in out
        and 'checkpoint.best.mode: "min"  # one of min, max' in out
    )
    assert any(
        line.startswith("ddp.timeout_s: null  # seconds > 0") and "1800" in line for line in out
    )
    assert len(out) == len(describe(TrainConfig)) > 70
