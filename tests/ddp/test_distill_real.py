"""The distill recipe (seed 000) on real SentenceTransformer models, 2 Gloo ranks.

Teacher (width 48) and student (width 32) are tiny BERT encoders built locally
(tests/ddp/_distill_models.py) and loaded by the recipe through
``SentenceTransformer(folder)``, the path a hub id takes; nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.parts import require_module

require_module("sentence_transformers")  # in the test extra: CI installs it
require_module("pyarrow")

from ddp.errors import ConfigError  # noqa: E402
from ddp.recipes import distill, resolve  # noqa: E402
from ddp.recipes._distill_io import read_corpus  # noqa: E402
from tests.ddp import _distill_models, _launch  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = _launch.ROOT
TEACHER_W, STUDENT_W = 48, 32


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _distill_models.build(tmp_path_factory.mktemp("models"))


def _argv(m: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "-m",
        "ddp",
        "distill",
        "--config",
        "configs/distill.yaml",
        "--teacher_model",
        str(m["teacher"]),
        "--student_model",
        str(m["student"]),
        "--train_data",
        str(m["train"]),
        "--val_data",
        str(m["pairs"]),
        "--output_dir",
        str(out),
        "--batch_size",
        "8",
        "--phase1_lr",
        "1e-3",
        "--phase2_lr",
        "5e-4",
        "--phase2_epochs",
        "1",
        "--set",
        "logging.progress=plain",
        "logging.every_n_steps=1",
        *extra,
    ]


def _run2(argv: list[str]) -> str:
    env_before = os.environ.get("HF_HUB_OFFLINE")
    assert env_before == "1"
    results = _launch.run(argv, world=2, timeout=400)
    for rank, (rc, o, e) in enumerate(results):
        assert rc == 0, f"rank {rank} exit {rc}\n{o[-2000:]}\n{e[-4000:]}"
    return results[0][1] + results[0][2]


def _records(out: Path, kind: str) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _stat(p: Path) -> tuple[int, int]:
    s = p.stat()
    return s.st_ino, s.st_mtime_ns


def _load_export(path: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    modules = json.loads((path / "modules.json").read_text())
    # sentence-transformers' own module classes only: nothing of this project's code
    assert all(mod["type"].startswith("sentence_transformers.") for mod in modules), modules
    return SentenceTransformer(str(path), device="cpu")  # trust_remote_code stays False


def _declared_width(path: Path) -> int:
    """The width the folder declares: its last Dense's out_features, else Pooling's."""
    modules = json.loads((path / "modules.json").read_text())
    for mod in reversed(modules):
        cfg = path / mod["path"] / "config.json"
        if mod["type"].endswith("Dense"):
            return json.loads(cfg.read_text())["out_features"]
        if mod["type"].endswith("Pooling"):
            return json.loads(cfg.read_text())["embedding_dimension"]
    raise AssertionError(modules)


def _mean_cos(st: Any, texts: list[str], teacher: torch.Tensor) -> float:
    emb = st.encode(texts, convert_to_tensor=True).float()
    return float(torch.nn.functional.cosine_similarity(emb, teacher.float(), dim=-1).mean())


def _cfg(m: dict[str, Path], out: Path, *sets: str) -> Any:
    return resolve(
        distill,
        ROOT / "configs/distill.yaml",
        [
            f"recipe.teacher_model={m['teacher']}",
            f"recipe.student_model={m['student']}",
            f"recipe.train_data={m['train']}",
            f"checkpoint.dir={out}",
            *sets,
        ],
    )


# ---- 2 ranks: both phases, the cache once, resume, the export ----------------------------
def test_projection_two_ranks_cache_once_resume_and_export(
    models: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    log = _run2(_argv(models, out, "--save_to_artifacts", "--artifacts_dir", "my_models"))
    assert "world=2" in log and "computing 48 embeddings on 2 rank(s)" in log
    # a cap above the corpus is said once, not silently clamped
    assert log.count("max_samples 500000 is above the corpus size 48") == 1
    # both phases ran: 48 texts / (8 x 2 ranks) = 3 steps each; phase 2's fresh schedule
    # restarts at its own LR (5e-4 x 2/3 after its first step) below phase 1's
    train = {r["step"]: r for r in _records(out, "train")}
    assert sorted(train) == [1, 2, 3, 4, 5, 6]
    assert train[1]["lr"] == pytest.approx(1e-3 * 2 / 3) and train[4]["lr"] == pytest.approx(
        5e-4 * 2 / 3
    )
    evals = _records(out, "eval")
    assert [e["step"] for e in evals] == [3, 6]
    for k in ("eval_cos", "eval_sim_mse", "eval_recall@1", "eval_recall@5", "eval_mrr"):
        assert k in evals[-1], evals[-1]
    assert 0 < evals[-1]["eval_mrr"] <= 1

    cache = out / "teacher_cache"
    assert sorted(p.name for p in cache.iterdir()) == [
        "train.json",
        "train.pt",
        "val.json",
        "val.pt",
    ]
    before = {p: _stat(cache / p) for p in ("train.pt", "train.json", "val.pt")}
    assert torch.load(cache / "train.pt", weights_only=True).shape == (48, TEACHER_W)

    # The export: beside final/model.pt, and the relative artifacts dir inside the run dir.
    assert (out / "final" / "model.pt").is_file()
    for path in (out / "final" / "sentence_transformer", out / "my_models"):
        st = _load_export(path)
        emb = st.encode(["a cat runs near the river", "blue sky"])
        assert emb.shape == (2, TEACHER_W) == (2, _declared_width(path))
        assert st.get_embedding_dimension() == TEACHER_W
    assert not (ROOT / "my_models").exists()

    # It learned: the export is closer to the teacher than the untrained student + head.
    val = read_corpus(str(models["pairs"]), "text", "--val_data", pairs_allowed=True)
    t_val = torch.load(cache / "val.pt", weights_only=True)
    untrained = distill.make_student(_cfg(models, tmp_path / "x"), TEACHER_W).st
    cos_before = _mean_cos(untrained, val.texts, t_val)
    cos_after = _mean_cos(_load_export(out / "my_models"), val.texts, t_val)
    assert cos_after > cos_before + 0.15, (cos_before, cos_after)

    # Resume with one more phase-2 epoch: the cache is read, not rebuilt or recomputed.
    log2 = _run2(_argv(models, out, "--phase2_epochs", "2"))
    assert "teacher cache" in log2 and "reused (48 texts)" in log2 and "computing" not in log2
    assert {p: _stat(cache / p) for p in before} == before
    assert max(r["step"] for r in _records(out, "train")) == 9


def test_mrl_two_ranks_every_prefix_learns(models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    log = _run2(
        _argv(
            models,
            out,
            "--use_projection=False",
            "--skip_phase1",
            "--phase2_epochs",
            "10",
            "--phase2_lr",
            "1e-3",
        )
    )
    assert "phase phase1 skipped" in log and "MRL [32, 16, 8]" in log
    last = _records(out, "eval")[-1]
    assert {"eval_sim_mse@32", "eval_sim_mse@16", "eval_sim_mse@8"} <= set(last)
    path = out / "final" / "sentence_transformer"
    st = _load_export(path)
    assert st.encode(["a red fish"]).shape == (1, STUDENT_W) == (1, _declared_width(path))
    assert not (path / "2_Dense").exists()

    # Measured on the training texts: 48 texts and 30 steps fit them, they do not generalise
    # to held-out ones reliably (that is the eval metrics' business, not this test's).
    texts = models["train"].read_text().splitlines()
    t = torch.load(out / "teacher_cache" / "train.pt", weights_only=True).float()
    untrained = distill.load_st(str(models["student"]), _cfg(models, tmp_path / "x"))
    for d in (32, 16, 8):
        gap_before, gap_after = (_sim_gap(m, texts, t, d) for m in (untrained, st))
        assert gap_after < 0.7 * gap_before, (d, gap_before, gap_after)


def _sim_gap(st: Any, texts: list[str], teacher: torch.Tensor, d: int) -> float:
    s = st.encode(texts, convert_to_tensor=True).float()[:, :d]
    return float((distill._sim(s, s) - distill._sim(teacher, teacher)).pow(2).mean())


# ---- the cache's key ------------------------------------------------------------------------
def test_a_cache_for_another_teacher_corpus_or_length_is_refused(
    models: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="ddp")
    distill.build(_cfg(models, out, "phases.0.max_samples=16", "phases.1.skip=true"))
    assert "computing 16 embeddings" in caplog.text
    other = tmp_path / "other.txt"
    other.write_text(models["train"].read_text().replace("cat", "puma"))
    for sets, named in [
        ([f"recipe.teacher_model={models['student']}"], "teacher"),
        ([f"recipe.train_data={other}"], "corpus sha256"),
        (["model.max_seq_length=16"], "max_seq_length 16"),
        (["recipe.teacher_dtype=bfloat16"], "dtype bfloat16"),
    ]:
        with pytest.raises(ConfigError, match=r"teacher cache .* holds embeddings of") as exc:
            distill.build(_cfg(models, out, "phases.1.skip=true", *sets))
        assert named in str(exc.value).split("this run has")[1] and "\n" not in str(exc.value)
    # The same key but more texts needed (phase 2 now runs): rebuilt, and said why.
    caplog.clear()
    built = distill.build(_cfg(models, out))
    assert "the cache holds 16 texts and this run needs 48" in caplog.text
    assert built.train_data.teacher.shape == (48, TEACHER_W)


def test_corpus_forms_agree_and_bad_input_is_one_line(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = read_corpus(str(models["train"]), "text", "--train_data")
    (tmp_path / "c.jsonl").write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts.texts))
    )
    pq.write_table(pa.table({"body": texts.texts}), tmp_path / "c.parquet")
    as_jsonl = read_corpus(str(tmp_path / "c.jsonl"), "text", "--train_data")
    as_parquet = read_corpus(str(tmp_path / "c.parquet"), "body", "--train_data")
    assert as_jsonl.texts == as_parquet.texts == texts.texts and len(texts.texts) == 48
    assert as_jsonl.digest == as_parquet.digest == texts.digest  # one corpus, one cache key
    pairs = read_corpus(str(models["pairs"]), "text", "--val_data", pairs_allowed=True)
    assert pairs.positives is not None and len(pairs.positives) == len(pairs.texts) == 16

    (tmp_path / "bin.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    for path, field, expected in [
        (tmp_path / "bin.txt", "text", "is binary"),
        (tmp_path / "bad.jsonl", "text", "record 2 of"),
        (tmp_path / "c.parquet", "text", "has no 'text' field"),
        (tmp_path / "bad.parquet", "text", "is not a readable Parquet file"),
        (tmp_path / "missing.txt", "text", "does not exist"),
    ]:
        with pytest.raises(ConfigError, match=expected) as exc:
            read_corpus(str(path), field, "--train_data")
        assert "\n" not in str(exc.value)


def test_missing_sentence_transformers_is_one_line_naming_the_extra(
    models: dict[str, Path],
) -> None:
    code = (
        "import sys; sys.modules['sentence_transformers'] = None; "
        "from ddp.__main__ import main; "
        f"sys.exit(main(['distill', '--train_data', {str(models['train'])!r}]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=_launch.base_env(),
        cwd=ROOT,
    )
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install 'hpc-ddp[distill]'" in lines[0], out.stderr


def test_online_teacher_gives_the_cached_targets(models: dict[str, Path], tmp_path: Path) -> None:
    """``--teacher_cache false`` (the benchmark's other arm) trains on the same targets."""
    cached = distill.build(_cfg(models, tmp_path / "a"))
    online = distill.build(_cfg(models, tmp_path / "b", "recipe.teacher_cache=false"))
    assert online.train_data.teacher is None and online.step_fn is not None
    assert not (tmp_path / "b" / "teacher_cache" / "train.pt").exists()
    items = [online.train_data[i] for i in range(5)]
    batch = online.collate_fn(items)
    loss_online = online.step_fn(online.model, batch)["loss"].detach()
    loss_cached = cached.model(cached.collate_fn([cached.train_data[i] for i in range(5)]))[
        "loss"
    ].detach()
    assert torch.allclose(batch["teacher"], cached.train_data.teacher[:5], atol=1e-5)
    assert float(loss_online) == pytest.approx(float(loss_cached), abs=1e-5)


def test_a_damaged_or_planted_cache_is_one_line(models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = _cfg(models, out, "phases.1.skip=true")
    distill.build(cfg)
    emb = out / "teacher_cache" / "train.pt"
    good = torch.load(emb, weights_only=True)
    for bad, expected in [
        (torch.full_like(good, float("nan")), "holds nan/inf"),
        ({"not": "a tensor"}, "holds dict"),
        (good[:5], r"holds \(5, 48\); allowed: a float matrix of at least 48 rows"),
    ]:
        torch.save(bad, emb)
        with pytest.raises(ConfigError, match=expected) as exc:
            distill.build(cfg)
        assert "\n" not in str(exc.value)
    emb.unlink()
    emb.symlink_to(tmp_path / "elsewhere.pt")  # a link planted in the run directory
    torch.save(good, tmp_path / "elsewhere.pt")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        distill.build(cfg)
