"""The seeds' local launch helpers: ``jobs/crowdbt_local.sh N ARGS`` (seed 003's
``./train_distributed.sh``) and ``jobs/distill_local.sh N True|False`` (seed 000's
``./run_ddp.sh``), thin scripts over ``hpc run`` taking the device count first.

They are run for real here, from a scratch working directory (where ``hpc run`` puts its
run folder): the device count must reach torchrun as ``--nproc_per_node N``, every other
word must reach the job verbatim (shell metacharacters included, nothing evaluated), and
a bad device count or projection word is one line, exit 2. The specs they run
(``jobs/crowdbt_cpu.yaml``, ``jobs/distill_cpu.yaml``) are rendered and checked with the
other checked-in scripts (``tests/hpc/test_render.py``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _helper(name: str, *args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID"):
        env.pop(k, None)
    return subprocess.run(
        ["bash", str(ROOT / "jobs" / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _configs(out: str) -> list[dict]:
    """The YAML documents the ranks printed (--print-config), one per rank."""
    docs, cur = [], []
    for line in out.splitlines():
        if line.startswith("training:") and cur:
            docs.append(yaml.safe_load("\n".join(cur)))
            cur = []
        if line and (line[0].isalpha() or line.startswith(" ")):
            cur.append(line)
    if cur:
        docs.append(yaml.safe_load("\n".join(cur)))
    return [d for d in docs if isinstance(d, dict) and "training" in d]


def _script(cwd: Path) -> str:
    (job,) = cwd.glob("runs/*/job.sh")
    return job.read_text()


def test_crowdbt_helper_count_first_and_words_verbatim(tmp_path: Path) -> None:
    hostile = "a b;$(touch pwned)`touch pwned2`'\""
    p = _helper(
        "crowdbt_local.sh",
        "2",
        "--print-config",
        "--batch-size",
        "16",
        "--data-dir",
        hostile,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    configs = _configs(p.stdout)
    assert len(configs) == 2, p.stdout[-2000:]  # one per rank: 2 ranks started
    assert all(c["recipe"]["data_dir"] == hostile for c in configs)
    assert all(c["training"]["batch_size"] == 16 for c in configs)
    assert not list(tmp_path.glob("pwned*"))
    assert "--nproc_per_node 2 -m ddp crowdbt --config " in _script(tmp_path)


@pytest.mark.parametrize(("word", "expected"), [("True", True), ("False", False), (None, True)])
def test_distill_helper_projection_word(tmp_path: Path, word: str | None, expected: bool) -> None:
    args = ["2"] + ([word] if word else []) + ["--print-config", "--batch_size=8"]
    p = _helper("distill_local.sh", *args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    configs = _configs(p.stdout)
    assert len(configs) == 2, p.stdout[-2000:]
    assert all(c["model"]["use_projection"] is expected for c in configs)
    assert all(c["training"]["batch_size"] == 8 for c in configs)
    assert "--nproc_per_node 2 -m ddp distill" in _script(tmp_path)


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("crowdbt_local.sh", [], "usage: "),
        ("crowdbt_local.sh", ["x", "--epochs", "1"], "device count 'x' is not allowed"),
        ("crowdbt_local.sh", ["0"], "device count '0' is not allowed"),
        ("crowdbt_local.sh", ["--epochs", "20"], "device count '--epochs' is not allowed"),
        ("distill_local.sh", ["4", "maybe"], "use_projection 'maybe' is not allowed"),
        ("distill_local.sh", ["-1"], "device count '-1' is not allowed"),
    ],
)
def test_bad_words_are_one_line(tmp_path: Path, name: str, args: list[str], needle: str) -> None:
    p = _helper(name, *args, cwd=tmp_path, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "runs").exists()  # nothing started


def test_crowdbt_helper_trains_on_two_ranks(tmp_path: Path) -> None:
    p = _helper(
        "crowdbt_local.sh",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--output-dir",
        "ck",
        "--lr",
        "3e-3",
        "--set",
        "recipe.n_images=16",
        "--set",
        "recipe.n_pairs=32",
        "--set",
        "recipe.n_eval_images=8",
        "--set",
        "recipe.n_eval_pairs=16",
        "--set",
        "logging.progress=plain",
        cwd=tmp_path,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    log = next(tmp_path.glob("runs/*/output.log")).read_text() + p.stdout + p.stderr
    assert "world=2" in log
    # a relative checkpoint.dir is taken from the run folder hpc run made ($HPC_RUN_DIR)
    assert len(list(tmp_path.glob("runs/*/ck/final/model.pt"))) == 1
