"""Sweeps: parsing --sweep flags, the task list, and the sweep.json manifest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpc import sweep
from hpc.errors import UserError
from hpc.sweep import SweepTask


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_parse_keeps_order_and_strings():
    assert sweep.parse(["optim.lr=0.1, 1e-3", "training.batch_size=32,64"]) == [
        ("optim.lr", ["0.1", "1e-3"]),
        ("training.batch_size", ["32", "64"]),
    ]


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([], "nothing to sweep"),
        (["optim.lr"], "no '='"),
        (["=0.1,0.2"], "empty key"),
        (["  =0.1"], "empty key"),
        (["optim.lr="], "no values"),
        (["optim.lr=0.1,,0.2"], "value 2 is empty"),
        (["optim.lr=0.1,"], "value 2 is empty"),
        (["optim.lr=0.1", "optim.lr=0.2"], "given twice"),
        (["optim.lr=0.1,0.1"], "value '0.1' given twice"),
        (["optim lr=0.1"], "not a config key"),
        (["../x=1"], "not a config key"),
        (["a=1\n2"], "control character"),
        (["a=" + "x" * 300], "at most 256"),
        (
            [f"a={','.join(map(str, range(21)))}", f"b={','.join(map(str, range(1000)))}"],
            "21 x 1000 = 21000 tasks; allowed: at most 20000",
        ),
    ],
)
def test_parse_refuses_with_one_line(items, expected):
    assert expected in _error(sweep.parse, items)


def test_cap_is_checked_before_expanding():
    # 10**12 tasks would never fit in memory: refused from the sizes alone.
    items = [f"k{i}={','.join(map(str, range(10)))}" for i in range(12)]
    assert "allowed: at most 20000" in _error(sweep.tasks_from_flags, items)


def test_exactly_the_cap_is_allowed():
    tasks = sweep.tasks_from_flags(
        ["a=" + ",".join(map(str, range(20))), "b=" + ",".join(map(str, range(1000)))]
    )
    assert len(tasks) == sweep.MAX_TASKS
    assert len({t.dirname for t in tasks}) == sweep.MAX_TASKS


def test_expand_is_the_cartesian_product_last_key_fastest():
    tasks = sweep.tasks_from_flags(["optim.lr=0.1,0.01", "training.batch_size=32,64,128"])
    assert [t.index for t in tasks] == list(range(6))
    assert [tuple(t.overrides.values()) for t in tasks] == [
        ("0.1", "32"),
        ("0.1", "64"),
        ("0.1", "128"),
        ("0.01", "32"),
        ("0.01", "64"),
        ("0.01", "128"),
    ]
    assert tasks[4].label == "optim.lr=0.01 training.batch_size=64"
    assert tasks[4].dirname == "004-lr-0.01_batch_size-64"
    assert sweep.set_args(tasks[4]) == ["--set", "optim.lr=0.01", "training.batch_size=64"]


@pytest.mark.parametrize(
    "value", ["../../etc", "/abs/path", ".hidden", "a b  c", "x" * 200, "$(rm -rf ~)", "%j", "é"]
)
def test_dirnames_are_safe(value):
    (task,) = sweep.tasks_from_flags([f"model.name={value}"])
    name = task.dirname
    assert "/" not in name and not name.startswith(".") and name not in (".", "..")
    assert len(name) <= sweep.MAX_DIRNAME
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in name), name
    assert name.startswith("000")
    assert task.overrides == {"model.name": value}  # the value itself is untouched


@pytest.mark.parametrize(
    ("value", "n", "expected"),
    [(1, 4, 1), ("4", 4, 4), (" 2 ", 4, 2)],
)
def test_max_parallel_ok(value, n, expected):
    assert sweep.check_max_parallel(value, n) == expected


@pytest.mark.parametrize("value", [0, -1, 5, "x", "", True, 2.5, "1e3", "\u0663", "\uff12"])
def test_max_parallel_refused(value):
    assert "allowed: 1 to 4" in _error(sweep.check_max_parallel, value, 4)


def test_manifest_round_trip_and_index_from_scheduler(tmp_path: Path):
    tasks = sweep.tasks_from_flags(["optim.lr=0.1,0.01", "seed=1,2"])
    path = sweep.write_manifest(tmp_path, tasks, max_parallel=2)
    assert path == tmp_path / "sweep.json"
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.json"]  # no temp file left
    assert sweep.read_manifest(tmp_path) == tasks
    assert sweep.task_for(tmp_path, environ={"SLURM_ARRAY_TASK_ID": "3"}) == tasks[3]
    assert sweep.task_for(tmp_path, environ={"PBS_ARRAY_INDEX": "1"}) == tasks[1]
    assert sweep.task_for(tmp_path, 2, environ={"SLURM_ARRAY_TASK_ID": "3"}) == tasks[2]
    assert sweep.task_dir(tmp_path, tasks[2]) == tmp_path / tasks[2].dirname


def test_manifest_write_replaces_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    old = sweep.tasks_from_flags(["a=1,2"])
    sweep.write_manifest(tmp_path, old)
    calls = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda s, d: (calls.append((s, d)), real(s, d)))
    new = sweep.tasks_from_flags(["a=3,4,5"])
    sweep.write_manifest(tmp_path, new)
    assert calls and Path(calls[0][1]) == tmp_path / "sweep.json"
    assert sweep.read_manifest(tmp_path) == new


@pytest.mark.parametrize(
    ("index", "environ", "expected"),
    [
        (None, {}, "no array index"),
        (None, {"SLURM_ARRAY_TASK_ID": "-1"}, "$SLURM_ARRAY_TASK_ID '-1' is not an array index"),
        (None, {"PBS_ARRAY_INDEX": "1x"}, "$PBS_ARRAY_INDEX '1x'"),
        (4, {}, "array index 4 is past the 4 tasks"),
        ("99999999", {}, "not an array index"),
        (True, {}, "not an array index"),
    ],
)
def test_task_for_refuses_bad_index(tmp_path: Path, index, environ, expected):
    sweep.write_manifest(tmp_path, sweep.tasks_from_flags(["a=1,2", "b=x,y"]))
    assert expected in _error(sweep.task_for, tmp_path, index, environ=environ)


def _good() -> dict:
    return {
        "version": 1,
        "max_parallel": None,
        "tasks": [t._asdict() for t in sweep.tasks_from_flags(["a=1,2"])],
    }


def _set(data: dict, path: tuple, value) -> dict:
    target = data
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: [d], "holds a list"),
        (lambda d: _set(d, ("version",), 2), "version 2"),
        (lambda d: _set(d, ("tasks",), []), "list of 1 to 20000"),
        (lambda d: _set(d, ("tasks",), {"0": {}}), "list of 1 to 20000"),
        (lambda d: _set(d, ("max_parallel",), 3), "max_parallel 3"),
        (lambda d: _set(d, ("max_parallel",), "1"), "max_parallel '1'"),
        (lambda d: _set(d, ("tasks", 1), "x"), "task 1 is not an object"),
        (lambda d: _set(d, ("tasks", 1, "extra"), 1), "task 1 is not an object"),
        (lambda d: _set(d, ("tasks", 1, "index"), 0), "index 0; allowed: 1"),
        (lambda d: _set(d, ("tasks", 1, "index"), 1.0), "index 1.0"),
        (lambda d: _set(d, ("tasks", 0, "overrides"), ["a=1"]), "overrides must be"),
        (lambda d: _set(d, ("tasks", 0, "overrides"), {}), "overrides must be"),
        (lambda d: _set(d, ("tasks", 0, "overrides"), {"a": 1}), "a is a int"),
        (lambda d: _set(d, ("tasks", 0, "overrides"), {"a;b": "1"}), "key 'a;b'"),
        (lambda d: _set(d, ("tasks", 0, "overrides"), {"a": "1\n"}), "control character"),
        (lambda d: _set(d, ("tasks", 0, "label"), None), "label must be"),
        (lambda d: _set(d, ("tasks", 0, "dirname"), "../x"), "dirname '../x'"),
        (lambda d: _set(d, ("tasks", 0, "dirname"), ".x"), "dirname '.x'"),
        (lambda d: _set(d, ("tasks", 0, "dirname"), ""), "dirname ''"),
        (lambda d: _set(d, ("tasks", 0, "dirname"), "a/b"), "dirname 'a/b'"),
        (lambda d: _set(d, ("tasks", 1, "dirname"), d["tasks"][0]["dirname"]), "used twice"),
    ],
)
def test_read_manifest_checks_untrusted_content(tmp_path: Path, change, expected):
    (tmp_path / "sweep.json").write_text(json.dumps(change(_good())))
    message = _error(sweep.read_manifest, tmp_path)
    assert expected in message and "sweep.json" in message


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", "is not JSON"),
        (b"{", "is not JSON"),
        (b"\xff\xfe\x00binary", "is not JSON"),
        (b"[" * 100_000, "is not JSON"),
        (b" " * (sweep.MAX_MANIFEST_BYTES + 1), "allowed: at most"),
    ],
)
def test_read_manifest_bad_files(tmp_path: Path, raw: bytes, expected: str):
    (tmp_path / "sweep.json").write_bytes(raw)
    assert expected in _error(sweep.read_manifest, tmp_path)


def test_read_manifest_missing(tmp_path: Path):
    assert "does not exist" in _error(sweep.read_manifest, tmp_path)


def test_sweep_task_is_plain_data():
    task = SweepTask(0, {"a": "1"}, "a=1", "000-a-1")
    assert task.overrides == {"a": "1"} and task._fields == (
        "index",
        "overrides",
        "label",
        "dirname",
    )


def test_array_task_evals_its_overrides_in_bash(tmp_path: Path):
    """The whole runtime path: sweep.json -> a task's bash -> the trainer's argv."""
    import subprocess
    import sys

    run = tmp_path / "run dir"
    run.mkdir()
    tasks = sweep.tasks_from_flags(["optim.lr=0.1,1e-3", "model.name=a b,$(touch pwned);'x'"])
    sweep.write_manifest(run, tasks)
    script = (
        'task=$("$PY" -m hpc.sweep shell "$RUN") || exit 2\neval "$task"\n'
        'printf "%s\\n" "$HPC_RUN_DIR" "$HPC_SWEEP_INDEX" "$HPC_SWEEP_LABEL" "${HPC_SWEEP_ARGS[@]}"\n'
    )
    env = {
        **os.environ,
        "PY": sys.executable,
        "RUN": str(run),
        "SLURM_ARRAY_TASK_ID": "3",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    task = tasks[3]
    assert done.stdout.splitlines() == [
        str(run / task.dirname),
        "3",
        task.label,
        "--set",
        "optim.lr=1e-3",
        "model.name=$(touch pwned);'x'",
    ]
    assert (run / task.dirname).is_dir() and not (tmp_path / "pwned").exists()

    env["SLURM_ARRAY_TASK_ID"] = "4"
    bad = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        f"hpc sweep: error: sweep: array index 4 is past the 4 tasks of "
        f"{str(run / 'sweep.json')!r}; allowed: 0 to 3"
    ]
