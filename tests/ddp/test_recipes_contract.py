"""The recipe contract: every recipe provides what ``python -m ddp`` relies on, takes the
common flags (defined once), builds the same initial weights whatever ran before, has its
YAML read and validated once, and ``python -m ddp RECIPE --help`` lists its flags with
their config keys and defaults. Nothing here trains.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ddp import recipes
from ddp.__main__ import main
from tests.ddp._launch import ROOT, base_env
from tests.support.parts import require_module

NAMES = recipes.names()


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPC_RUN_DIR", raising=False)  # would move a relative checkpoint.dir
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps help at the terminal width
    monkeypatch.chdir(ROOT)


def _print_config(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main([*argv, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddp: error: "), err
    return err[0]


# ---- contract -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_satisfies_the_contract(name: str) -> None:
    recipe = recipes.get(name)
    assert isinstance(recipe, recipes.Recipe) and recipe.NAME == name
    own = {n for f in recipe.FLAGS for n in (f.name, *f.aliases)}
    common = {n for f in recipes.COMMON_FLAGS for n in (f.name, *f.aliases)}
    assert not own & common, f"{name} redefines common flags {own & common}"


def test_a_module_missing_a_part_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(recipes.RECIPES, "broken", "ddp.recipes._common")
    with pytest.raises(TypeError, match="ddp.recipes._common is not a recipe: missing NAME"):
        recipes.get("broken")


def test_main_needs_no_type_ignore() -> None:
    assert "type: ignore" not in (ROOT / "src" / "ddp" / "__main__.py").read_text()


# ---- common flags -------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("spelling", ["_", "-"])
def test_common_flags_work_for_every_recipe(
    name: str, spelling: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _print_config(
        capsys,
        [
            name,
            "--backend",
            "gloo",
            f"--output{spelling}dir",
            "out/common",
            "--seed",
            "5",
            f"--max{spelling}steps",
            "7",
        ],
    )
    assert cfg["ddp"]["backend"] == "gloo" and cfg["checkpoint"]["dir"] == "out/common"
    assert (cfg["training"]["seed"], cfg["training"]["max_steps"]) == (5, 7)


@pytest.mark.parametrize(
    ("name", "flag"),
    [
        ("uniref50", "--work_dir"),
        ("dpo", "--output_dir"),
        ("distill", "--output_dir"),
        ("crowdbt", "--output-dir"),
        ("gnn", "--output-dir"),
    ],
)
def test_each_seeds_own_output_flag_still_works(
    name: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _print_config(capsys, [name, flag, "d/x"])["checkpoint"]["dir"] == "d/x"


def test_set_still_wins_over_a_common_flag(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _print_config(capsys, ["gnn", "--seed", "5", "--set", "training.seed=9"])
    assert cfg["training"]["seed"] == 9


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["dpo", "--bogus"], "unrecognized arguments: --bogus"),
        (["dpo", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
        (["distill", "--skip_phase1", "maybe"], "expected true or false, got 'maybe'"),
        (["gnn", "--config"], "argument --config: expected one argument"),
        ([], "a recipe name is required"),
    ],
)
def test_bad_command_lines_are_one_line_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert expected in _one_error_line(capsys)


# ---- same initial weights -----------------------------------------------------------------
def test_seeded_model_ignores_earlier_draws_and_restores_the_callers_stream() -> None:
    torch.manual_seed(1)
    a = recipes.seeded_model(3, lambda: torch.nn.Linear(4, 4))
    expected_next = torch.rand(3)
    torch.manual_seed(1)
    torch.rand(100)  # the caller drew other numbers first (data generation, another rank)
    b = recipes.seeded_model(3, lambda: torch.nn.Linear(4, 4))
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    torch.manual_seed(1)
    recipes.seeded_model(3, lambda: torch.nn.Linear(4, 4))
    assert torch.equal(torch.rand(3), expected_next)  # the caller's stream is untouched
    assert not torch.equal(recipes.seeded_model(4, lambda: torch.nn.Linear(4, 4)).weight, a.weight)


SMALL = {
    "uniref50": [],
    "dpo": [],
    "distill": [],  # real local models: see _small
    "crowdbt": [
        "recipe.n_images=16",
        "recipe.n_eval_images=8",
        "recipe.n_pairs=32",
        "recipe.n_eval_pairs=16",
    ],
    "gnn": ["recipe.n_train=6", "recipe.n_eval=3"],
}


def _small(name: str, tmp_path: Path) -> list[str]:
    """SMALL[name]; distill's teacher and student are tiny real folders built locally."""
    if name != "distill":
        return SMALL[name]
    require_module("sentence_transformers")  # in the test extra: CI installs it
    from tests.ddp import _distill_models

    m = _distill_models.shared()
    return [
        f"recipe.teacher_model={m['teacher']}",
        f"recipe.student_model={m['student']}",
        f"recipe.train_data={m['train']}",
        f"checkpoint.dir={tmp_path}",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_builds_the_same_weights_whatever_ran_before(
    name: str, tmp_path: Path
) -> None:
    recipe = recipes.get(name)
    small = _small(name, tmp_path)
    cfg = recipes.resolve(recipe, None, small)
    states = []
    for earlier_seed in (0, 12345):  # as if two ranks had drawn different numbers before
        torch.manual_seed(earlier_seed)
        torch.rand(earlier_seed % 97 + 1)
        states.append(recipe.build(cfg).model.state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    other = recipe.build(recipes.resolve(recipe, None, [*small, "training.seed=1"]))
    assert any(not torch.equal(states[0][k], v) for k, v in other.model.state_dict().items())


@pytest.mark.parametrize("name", NAMES)
def test_recipes_seed_weights_only_through_seeded_model(name: str) -> None:
    """One way to seed weights: no recipe reseeds the global RNG or forks it itself."""
    tree = ast.parse(Path(recipes.get(name).__file__ or "").read_text())
    calls = {
        f"{n.func.value.id}.{n.func.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
    }
    assert not calls & {"torch.manual_seed", "random.fork_rng", "torch.seed"}, calls


# ---- YAML read once -----------------------------------------------------------------------
def test_the_yaml_is_read_once_and_validated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[dict[str, Any]] = []
    built: list[dict[str, Any] | None] = []
    real_read, real_from_dict = recipes.read_yaml, recipes.TrainConfig.from_dict

    def read(path: str | Path) -> dict[str, Any]:
        reads.append(real_read(path))
        return reads[-1]

    def from_dict(data: dict[str, Any] | None) -> recipes.TrainConfig:
        built.append(data)
        return real_from_dict(data)

    monkeypatch.setattr(recipes, "read_yaml", read)
    monkeypatch.setattr(recipes.TrainConfig, "from_dict", staticmethod(from_dict))
    cfg = recipes.resolve(recipes.get("dpo"), ROOT / "configs" / "dpo.yaml", ["optim.lr=2e-3"])
    assert cfg.optim.lr == 2e-3
    assert len(reads) == 1
    assert not any(data is reads[0] for data in built)  # not built once alone, then merged


def test_a_bad_key_in_the_file_is_still_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lrr: 1\n")
    assert main(["dpo", "--config", str(bad)]) == 2
    assert "unknown key 'optim.lrr'; did you mean 'optim.lr'?" in _one_error_line(capsys)


# ---- --help -------------------------------------------------------------------------------
def _help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", NAMES)
def test_recipe_help_lists_its_flags_keys_and_defaults(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _help(capsys, [name, "--help"])
    defaults = recipes.resolve(recipes.get(name))
    for flag in recipes.all_flags(recipes.get(name)):
        assert flag.name in out, flag.name
        value = recipes._value_at(defaults, flag.key)
        assert f"[{flag.key}; default: {value!r}]" in out, flag.key


def test_recipe_help_defaults_follow_config_and_set(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys, ["gnn", "-h", "--config", "configs/gnn.yaml", "--set", "model.hidden=8"])
    assert "[model.hidden; default: 8]" in out and "[model.layers; default: 3]" in out
    assert "[checkpoint.dir; default: 'checkpoints/gnn']" in out
    # A broken --set still gives help (with the recipe's own defaults); the run reports it.
    out = _help(capsys, ["gnn", "--help", "--set", "model.hiden=8"])
    assert "[model.hidden; default: 32]" in out


def test_help_as_a_command() -> None:
    """The real entry point: ``python -m ddp RECIPE --help`` exits 0 with the recipe's flags."""
    out = subprocess.run(
        [sys.executable, "-m", "ddp", "distill", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=base_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0 and out.stderr == ""
    text = " ".join(out.stdout.split())  # unwrap argparse's line breaks
    assert (
        "distill flags" in text
        and "--phase1_lr" in text
        and "[phases.0.lr; default: 2e-05]" in text
    )
    top = subprocess.run(
        [sys.executable, "-m", "ddp", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=base_env(),
        cwd=ROOT,
    )
    assert top.returncode == 0 and "python -m ddp RECIPE --help" in top.stdout
