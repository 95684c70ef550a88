"""Seed 002 (gnn) for real: the user's own graphs with node and edge features, from a
PyTorch Geometric dataset and from the library-free .pt format, on 2 real Gloo ranks;
exact evaluation (1 rank == 2 ranks); W&B as the seed uses it (run name, epoch, finish).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.ddp import _launch

PLAIN = ["--set", "logging.progress=plain"]


def _run(out: Path, *args: str, world: int = 2, ok: bool = True) -> list[tuple[int, str, str]]:
    argv = ["-m", "ddp", "gnn", "--config", "configs/gnn.yaml", *PLAIN,
            "--set", f"checkpoint.dir={out}", *args]  # fmt: skip
    results = _launch.run(argv, world=world, timeout=240)
    if ok:
        for rank, (rc, o, e) in enumerate(results):
            assert rc == 0, f"rank {rank} exit {rc}\n{o[-2000:]}\n{e[-3000:]}"
    return results


def _records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# ---- W&B as seed 002 uses it ----------------------------------------------------------------
SMALL = ["--set", "recipe.n_train=48", "--set", "recipe.n_eval=24", "--hidden", "16"]


def _wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline W&B into tmp_path (the ranks inherit the test's environment)."""
    pytest.importorskip("wandb", reason="wandb is in the test extra")
    for k, v in {"WANDB_DIR": str(tmp_path), "WANDB_MODE": "offline",
                 "WANDB_SILENT": "true"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)


def _wandb_file(tmp_path: Path) -> bytes:
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 only
    (history,) = runs[0].glob("run-*.wandb")
    return history.read_bytes()


def test_wandb_offline_run_has_the_run_name_and_epoch(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    _wandb_env(tmp_path, monkeypatch)
    out = tmp_path / "ck"
    _run(out, "--epochs", "2", *SMALL, "--wandb-project", "cricket-gnn",
         "--run-name", "seed-002-run")  # fmt: skip
    data = _wandb_file(tmp_path)
    # wandb 0.31 writes protobuf records (read in Go only): the run record's display_name
    # (field 8) is the run name, and each history item is its key then its value as JSON.
    assert b"B\x0cseed-002-run" in data
    epochs = {int(v) for v in re.findall(rb"\x12\x05epoch\x82\x01.(\d+)", data)}
    logged = {r["epoch"] for r in _records(out, "train")}
    assert epochs == logged == {0, 1}
    # wandb.finish() ran: the exit record (field 18) is there, exit code 0 (omitted)
    assert re.search(rb"\x92\x01\x02\x10", data), data[-200:]


def test_wandb_finishes_failed_when_rank_0_dies(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A diverged run ends every rank through ddp.parts.die (os._exit, no `finally`):
    rank 0 still calls wandb.finish(exit_code=1) first."""
    _wandb_env(tmp_path, monkeypatch)
    results = _run(tmp_path / "ck", "--epochs", "2", *SMALL, "--lr", "1e37",
                   "--set", "optim.grad_clip=null", "--wandb-project", "cricket-gnn",
                   ok=False)  # fmt: skip
    assert results[0][0] == 2 and "training diverged" in results[0][2]
    data = _wandb_file(tmp_path)
    assert re.search(rb"\x92\x01.\x08\x01", data), data[-200:]  # exit record, exit_code 1
