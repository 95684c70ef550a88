"""The login side's one schema mechanism (hpc.schema): each key of the job spec and of a
cluster profile is declared once, and its check and one-line message come from there."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from hpc import profiles, profiles_check, spec
from hpc.cluster import Cluster, Launcher, Queue, Rule, Tiles
from hpc.errors import UserError
from hpc.schema import Key, Table
from hpc.spec import JobSpec
from tests.hpc.conftest import REPO

HPC = REPO / "hpc"
#: Every table of the login side: the spec's, the profile's and the profile's nested ones.
TABLES = {
    "spec": spec.SPEC,
    "resilience": spec.RESILIENCE_KEYS,
    "profile": profiles.PROFILE,
    "launcher": profiles.LAUNCHER,
    "queue": profiles_check.QUEUE,
    "bin": profiles_check.BIN,
    "rule": profiles_check.RULE,
    "when": profiles_check.WHEN,
    "tiles": profiles_check.TILES,
    "charge": profiles_check.CHARGE,
}


def _spec_error(data: dict[str, Any]) -> str:
    with pytest.raises(UserError) as info:
        JobSpec.from_mapping(data, "s.yaml")
    return str(info.value)


def _load(tmp_path: Path, text: str) -> Cluster:
    folder = tmp_path / "clusters"
    folder.mkdir(exist_ok=True)
    (folder / "t.yaml").write_text(text)
    return profiles.load("t", {"HPC_DDP_CLUSTERS": str(folder)}, tmp_path)


def _profile_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(UserError) as info:
        _load(tmp_path, text)
    return str(info.value).replace(str(tmp_path / "clusters"), "D")


def test_a_bound_changed_in_the_table_changes_the_check_and_its_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert JobSpec.from_mapping({"nodes": 1}).nodes == 1
    monkeypatch.setattr(spec.SPEC["nodes"], "low", 2)
    assert _spec_error({"nodes": 1}) == (
        "nodes: 1 is not allowed; allowed: a whole number from 2 to 10000000"
    )

    assert JobSpec.from_mapping({"resilience": {"spares": 6}}).resilience["spares"] == 6
    monkeypatch.setattr(spec.RESILIENCE_KEYS["spares"], "high", 5)
    assert _spec_error({"resilience": {"spares": 6}}) == (
        "resilience.spares: 6 is not allowed; allowed: a whole number from 0 to 5"
    )

    assert _load(tmp_path, "scheduler: slurm\npoll_s: 20\n").poll_s == 20.0
    monkeypatch.setattr(profiles.PROFILE["poll_s"], "high", 10.0)
    assert _profile_error(tmp_path, "scheduler: slurm\npoll_s: 20\n") == (
        "cluster t: poll_s: 20 is not allowed; allowed: seconds, a number from 0.1 to 10"
    )


def test_a_choice_changed_in_the_table_changes_the_check_and_its_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spec.SPEC["wrap"], "choices", ("auto", "never", "sometimes"))
    assert JobSpec.from_mapping({"wrap": "sometimes"}).wrap == "sometimes"
    assert _spec_error({"wrap": "sometime"}) == (
        "wrap: 'sometime' is not allowed (did you mean sometimes?); allowed: auto, never, sometimes"
    )


@pytest.mark.parametrize("name", sorted(TABLES))
def test_an_unknown_key_names_the_nearest_key_of_its_table(name: str) -> None:
    table = TABLES[name]
    for key in table.names():
        typo = key[:-1] + ("x" if key[-1] != "x" else "y")  # one letter off
        with pytest.raises(UserError) as info:
            table.check_keys({typo: 1}, name)
        msg = str(info.value)
        assert msg.startswith(f"{name}: unknown key {typo!r} (did you mean ")
        assert msg.endswith(f"; allowed: {', '.join(sorted(table.names()))}")


def test_a_key_added_to_a_table_is_read_checked_and_suggested() -> None:
    table = Table((Key("alpha", "int", 4, "a number", low=1, high=9), Key("beta", "bool")))
    assert table.read({}) == {"alpha": 4, "beta": None}
    assert table.read({"alpha": 7, "beta": True}, "x") == {"alpha": 7, "beta": True}
    with pytest.raises(
        UserError, match=r"^x: alpha: 10 is not allowed; allowed: a whole number from 1 to 9$"
    ):
        table.read({"alpha": 10}, "x")
    with pytest.raises(UserError, match=r"unknown key 'alpah' \(did you mean alpha\?\)"):
        table.check_keys({"alpah": 1}, "x")


@pytest.mark.parametrize(
    ("table", "model"),
    [
        (spec.SPEC, JobSpec),
        (profiles.PROFILE, Cluster),
        (profiles.LAUNCHER, Launcher),
        (profiles_check.QUEUE, Queue),
        (profiles_check.RULE, Rule),
        (profiles_check.TILES, Tiles),
    ],
)
def test_each_default_is_the_frozen_types_own(table: Table, model: type) -> None:
    """The table reads its defaults from the type (built in Python too), so they agree."""
    own = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(model)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    shared = [k for k in table.defaults() if k in own]
    assert len(shared) >= 3
    assert {k: table.defaults()[k] for k in shared} == {k: own[k] for k in shared}


def test_every_key_is_declared_with_its_help() -> None:
    for name, table in TABLES.items():
        for key in table.keys:
            assert key.help, f"{name}.{key.name} has no help"
            assert callable(key.choices) or key.describe(), f"{name}.{key.name}"
    # the spec's keys are the table's (submit_many reads SPEC_KEYS)
    assert set(spec.SPEC_KEYS) == {f.name for f in dataclasses.fields(JobSpec)} - {"source"} | {
        "partition"
    }


def test_every_existing_message_is_unchanged(tmp_path: Path) -> None:
    """Each line below was printed by the hand-written checks this table replaced (the
    spec's counts since with their upper bound, ``hpc._util.MAX_COUNT``)."""
    cases = json.loads((REPO / "tests" / "hpc" / "data" / "schema_messages.json").read_text())
    assert len(cases) > 150
    for case in cases:
        if "spec" in case:
            assert _spec_error(case["spec"]) == case["message"], case
        else:
            text = case["profile"]
            text = text if "scheduler" in text else "scheduler: slurm\n" + text
            assert _profile_error(tmp_path, text) == case["message"], case


def test_a_number_where_the_size_bins_go_is_one_line(tmp_path: Path) -> None:
    """``bins: 5`` raised TypeError from the hand-written loop; the table says what goes."""
    assert _profile_error(tmp_path, "scheduler: slurm\nqueues: {q: {bins: 5}}\n") == (
        "cluster t: queues.q.bins[0]: allowed: a mapping with nodes and walltime"
    )


def _defs(pattern: str) -> dict[str, int]:
    found = {}
    for path in HPC.rglob("*.py"):
        n = len(re.findall(pattern, path.read_text()))
        if n:
            found[str(path.relative_to(REPO))] = n
    return found


def test_no_other_validator_remains() -> None:
    """The field checks exist once, in hpc.schema; no module writes its own again."""
    for name in ("_int", "_choice", "_strings", "_bool", "_str"):
        assert _defs(rf"\bdef {name}\(") == {"hpc/schema.py": 1}, name
    # the one-line message is written by hpc.schema.refuse, not by each reader
    for mine in ("spec.py", "profiles.py", "profiles_check.py", "cluster.py"):
        assert "is not allowed;" not in (HPC / mine).read_text(), mine


def test_the_variable_name_pattern_is_written_once() -> None:
    assert _defs(re.escape("[A-Za-z_][A-Za-z0-9_]*")) == {"hpc/_util.py": 1}


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        ('account_required: "no"', "'no'"),
        ('account_required: "false"', "'false'"),
        ("account_required: 0", "0"),
        ("account_required: [x]", "['x']"),
        ('charge: {machine_factor_required: "no"}', "'no'"),
    ],
)
def test_a_switch_is_true_or_false_never_a_truth_value(
    tmp_path: Path, line: str, shown: str
) -> None:
    """``account_required: "no"`` was read as its truth value (a non-empty string: true),
    so every job on the profile demanded an account; a switch takes true or false only."""
    key = "charge.machine_factor_required" if "charge" in line else "account_required"
    assert _profile_error(tmp_path, f"scheduler: slurm\n{line}\n") == (
        f"cluster t: {key}: {shown} is not allowed; allowed: true or false"
    )


@pytest.mark.parametrize(("value", "want"), [("true", True), ("false", False), ("", False)])
def test_a_switch_written_true_false_or_left_empty(tmp_path: Path, value: str, want: bool) -> None:
    """Empty (YAML null) keeps the default, as every other nullable key does."""
    assert (
        _load(tmp_path, f"scheduler: slurm\naccount_required: {value}\n").account_required is want
    )
