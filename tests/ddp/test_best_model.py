"""``checkpoint.best`` (issue 27.3, seed 002's ``best_model.pt``) for every recipe: the
Trainer keeps ``best/model.pt`` when the evaluation improves, and only then, from real
2-rank Gloo runs of the generic Trainer (tests/ddp/_train_worker.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.ddp import _launch

WORKER = "tests/ddp/_train_worker.py"


def _cfg(ck: Path, epochs: int, **best: str) -> dict:
    return {
        "training": {"batch_size": 4, "epochs": epochs, "shuffle": True, "seed": 3},
        "optim": {"name": "sgd", "lr": 0.3},
        "checkpoint": {"dir": str(ck), "best": best},
        "logging": {"every_n_steps": 2, "progress": "plain"},
    }


def _run(cfg: dict, world: int = 2) -> list[tuple[int, str, str]]:
    return _launch.run(
        [WORKER, json.dumps({"config": cfg, "n": 32, "eval_n": 12})], world=world, timeout=120
    )


def _ok(results: list[tuple[int, str, str]]) -> str:
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{out[-2000:]}\n{err[-3000:]}"
    assert "best model:" not in results[-1][1] + results[-1][2]  # rank 0 writes and says
    return results[0][1] + results[0][2]


def _evals(ck: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (ck / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in recs if r["kind"] == "eval"]


def _improvements(evals: list[tuple[int, float]], better) -> list[int]:
    best, steps = math.nan, []
    for step, value in evals:
        if math.isnan(best) or better(value, best):
            best = value
            steps.append(step)
    return steps


def _written(log: str) -> list[int]:
    return [
        int(line.split(" at step ")[1].split()[0])
        for line in log.splitlines()
        if line.startswith("best model:")
    ]


def test_best_model_is_written_on_each_improvement_only(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    log = _ok(_run(_cfg(ck, 6, metric="eval/loss", mode="min")))
    evals = _evals(ck)
    assert len(evals) == 6
    want = _improvements(evals, lambda v, b: v < b)
    assert _written(log) == want  # one write per improvement, none otherwise
    meta = json.loads((ck / "best" / "best.json").read_text())
    step, value = min(evals, key=lambda e: e[1])
    assert (meta["step"], meta["metric"]) == (step, "eval_loss")
    assert meta["value"] == value
    # final/'s export format: a plain state_dict that loads with weights_only
    best = torch.load(ck / "best" / "model.pt", weights_only=True)
    final = torch.load(ck / "final" / "model.pt", weights_only=True)
    assert best.keys() == final.keys() and not any(k.startswith("module.") for k in best)
    assert (ck / "best" / "config.yaml").is_file()
    # the seed's name is an alias of the same file
    alias = torch.load(ck / "best_model.pt", weights_only=True)
    assert all(torch.equal(alias[k], best[k]) for k in best)
    if step != evals[-1][0]:  # the last epoch was not the best: best differs from final
        assert any(not torch.equal(best[k], final[k]) for k in best)


def test_mode_max_on_a_falling_loss_keeps_the_first_evaluation(tmp_path: Path) -> None:
    """The direction is honoured: only evaluations above the best are written."""
    ck = tmp_path / "ck"
    log = _ok(_run(_cfg(ck, 4, metric="eval_loss", mode="max")))
    evals = _evals(ck)
    assert _written(log) == _improvements(evals, lambda v, b: v > b)
    assert len(_written(log)) < len(evals)  # the loss falls: not every evaluation wins


def test_a_resumed_run_keeps_the_best_it_had(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    first = _ok(_run(_cfg(ck, 3, metric="eval/loss")))
    evals = _evals(ck)
    log = _ok(_run(_cfg(ck, 6, metric="eval/loss")))
    later = _evals(ck)[len(evals) :]
    assert "resuming from" in log and len(later) == 3
    best_before = min(v for _, v in evals)
    want = _improvements([(0, best_before), *later], lambda v, b: v < b)[1:]
    assert _written(log) == want, (first, evals, later)
    assert json.loads((ck / "best" / "best.json").read_text())["value"] == min(
        v for _, v in evals + later
    )


def test_no_best_without_the_key(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    cfg = _cfg(ck, 2)
    del cfg["checkpoint"]["best"]
    log = _ok(_run(cfg, world=1))
    assert not (ck / "best").exists() and not (ck / "best_model.pt").exists()
    assert "best model:" not in log


def test_an_unknown_metric_is_one_line(tmp_path: Path) -> None:
    """Through ``python -m ddp`` as a user runs it: one line, exit 2, at the first eval."""
    ((rc, out, err),) = _launch.run(
        [
            "-m",
            "ddp",
            "gnn",
            "--set",
            "logging.progress=plain",
            "--output_dir",
            str(tmp_path / "ck"),
            "--epochs",
            "1",
            "--set",
            "recipe.n_train=16",
            "--set",
            "recipe.n_eval=8",
            "--set",
            "checkpoint.best.metric=eval/accuracy",
        ],
        world=1,
        timeout=120,
    )
    assert rc == 2, err[-2000:]
    assert err.strip() == (
        "ddp: error: checkpoint.best.metric: 'eval/accuracy' is not a "
        "metric this run evaluates; allowed: eval/acc, eval/loss"
    )
