"""Teacher-to-student embedding distillation in two phases (seed 000), on real models.

The seed distils a large retriever (``infly/inf-retriever-v1-pro``) into
``sentence-transformers/all-mpnet-base-v2``. Both are loaded here exactly as a user
loads them, ``SentenceTransformer(hub id or local folder)``, with
``trust_remote_code`` off unless ``--trust_remote_code`` is given and the teacher in
``--teacher_dtype`` (bf16/fp16 halve its memory). The corpus is ``--train_data``: a
text file (one text per line), JSON Lines or Parquet with a text field, or a saved
Hugging Face dataset; each batch is tokenized with the student's own tokenizer.

The teacher is frozen, so its embedding of every training text is computed once,
sharded across the ranks, and cached under the run directory
(:mod:`ddp.recipes._distill_io`); every phase, epoch and resume reads it, and a resumed
run does not even load the teacher. ``--teacher_cache false`` runs the teacher on each
batch instead (for a corpus too large for the disk, and for bench/distill_cache.py).

Two modes (``--use_projection``):

* projection (default): a ``Dense`` module (student width -> teacher width, no
  activation) is appended after the student's pooling and the loss is
  ``1 - cos(student, teacher)``; the exported model embeds into the teacher's space.
* MRL (``--use_projection=False``): no head. For every prefix width m in
  ``model.mrl_dims`` (default: the student width halved down to 8, at most 5 sizes) the
  in-batch cosine-similarity matrix of the first m dims is pulled towards the
  teacher's (MSE), Matryoshka-style, so truncated embeddings stay usable. Similarity
  matrices compare across widths, so the student keeps its own width.

Phases are the Trainer's ``phases:`` (own epochs, LR, sample cap, skip; a fresh
optimizer each), with the seed's defaults. Evaluation on ``--val_data``: the cosine to
the teacher (projection mode), the gap between the student's and the teacher's
similarities to anchor texts per prefix, and, when the file holds (query, positive)
pairs, recall@k and MRR of each query's positive among all positives.

Export: ``final/sentence_transformer`` beside the Trainer's ``final/model.pt`` (and a
copy in ``--artifacts_dir`` with ``--save_to_artifacts``), written by
``SentenceTransformer.save``: only sentence-transformers' own modules, so
``SentenceTransformer(path)`` loads it with no custom code.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import ddp
from ddp.config import TrainConfig
from ddp.errors import ConfigError
from ddp.recipes import Built, Flag
from ddp.recipes._distill_eval import _PerWeights, make_eval_fn  # noqa: F401
from ddp.recipes._distill_io import (  # noqa: F401  (EXTRA: re-exported)
    EXTRA,
    cache_key,
    read_corpus,
    teacher_embeddings,
)

# Re-exported: tests name them ``ddp.recipes.distill.X``.
from ddp.recipes._distill_model import (  # noqa: F401
    DistillModel,
    _dense,
    _require,
    _sim,
    _width,
    load_st,
    make_student,
    mrl_dims,
    tokenize,
)

log = logging.getLogger("ddp")

NAME = "distill"
DESCRIPTION = (
    "embedding distillation: SentenceTransformer teacher -> student, 2 phases, proj or MRL"
)

DTYPES = ("float32", "bfloat16", "float16", "auto")

DEFAULTS: dict[str, Any] = {
    "training": {"batch_size": 64, "epochs": 1, "seed": 0},
    # weight_decay 0.01 and grad_clip 1.0: sentence-transformers' own fit() defaults.
    "optim": {
        "name": "adamw",
        "lr": 2e-5,
        "weight_decay": 0.01,
        "schedule": "linear",
        "warmup_steps": 0,
        "grad_clip": 1.0,
    },
    "phases": [
        {"name": "phase1", "epochs": 1, "lr": 2e-5, "max_samples": 100000},
        {"name": "phase2", "epochs": 3, "lr": 5e-6, "max_samples": 500000},
    ],
    # A Hugging Face encoder's pooler (BERT, MPNet) gets no gradient from a pooled-token
    # loss; DDP must be told, or its second step fails waiting for those gradients.
    "ddp": {"find_unused_parameters": True},
    "checkpoint": {"dir": "checkpoints/distill"},
    "logging": {"every_n_steps": 10},
    "model": {"use_projection": True, "mrl_dims": [], "max_seq_length": None},
    "recipe": {
        "teacher_model": "infly/inf-retriever-v1-pro",
        "student_model": "sentence-transformers/all-mpnet-base-v2",
        "train_data": None,
        "val_data": None,
        "text_field": "text",
        "teacher_dtype": "float32",
        "teacher_batch_size": 64,
        "teacher_cache": True,
        "trust_remote_code": False,
        "n_anchors": 64,
        "recall_at": [1, 5, 10],
        "save_to_artifacts": False,
        "artifacts_dir": "./artifacts",
    },
}

FLAGS = [
    Flag("--teacher_model", "recipe.teacher_model", str, "teacher: hub id or local folder"),
    Flag("--student_model", "recipe.student_model", str, "student: hub id or local folder"),
    Flag("--use_projection", "model.use_projection", bool, "projection head (true) or MRL (false)"),
    Flag("--batch_size", "training.batch_size", int, "batch size per rank"),
    Flag("--phase1_epochs", "phases.0.epochs", int, "phase 1 epochs"),
    Flag("--phase2_epochs", "phases.1.epochs", int, "phase 2 epochs"),
    Flag("--phase1_lr", "phases.0.lr", float, "phase 1 learning rate"),
    Flag("--phase2_lr", "phases.1.lr", float, "phase 2 learning rate"),
    Flag("--max_samples_phase1", "phases.0.max_samples", int, "max training samples in phase 1"),
    Flag("--max_samples_phase2", "phases.1.max_samples", int, "max training samples in phase 2"),
    Flag("--skip_phase1", "phases.0.skip", bool, "skip phase 1 (true/false)"),
    Flag("--skip_phase2", "phases.1.skip", bool, "skip phase 2 (true/false)"),
    Flag(
        "--save_to_artifacts", "recipe.save_to_artifacts", bool, "export for inference at the end"
    ),
    Flag(
        "--artifacts_dir",
        "recipe.artifacts_dir",
        str,
        "where --save_to_artifacts writes (relative: inside the run directory)",
    ),
    Flag(
        "--train_data",
        "recipe.train_data",
        str,
        "corpus: .txt lines, .jsonl, .parquet, dataset dir",
    ),
    Flag("--val_data", "recipe.val_data", str, "held-out texts, or query/positive pairs"),
    Flag("--text_field", "recipe.text_field", str, "the text field of .jsonl/.parquet records"),
    Flag("--teacher_dtype", "recipe.teacher_dtype", str, "teacher weights: " + ", ".join(DTYPES)),
    Flag("--max_seq_length", "model.max_seq_length", int, "token limit (teacher and student)"),
    Flag("--teacher_cache", "recipe.teacher_cache", bool, "cache teacher embeddings on disk"),
    Flag("--trust_remote_code", "recipe.trust_remote_code", bool, "run model code from the hub"),
    Flag("--precision", "precision", str, "student training precision: fp32, bf16, fp16"),
]


# ---- data -------------------------------------------------------------------------------
class TextSet(Dataset):
    """Texts with their teacher embeddings (None: the teacher runs on each batch)."""

    def __init__(
        self, texts: list[str], teacher: torch.Tensor | None, positives: list[str] | None = None
    ) -> None:
        self.texts, self.teacher, self.positives = texts, teacher, positives

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item: dict[str, Any] = {"text": self.texts[i], "index": i}
        if self.teacher is not None:
            item["teacher"] = self.teacher[i]
        return item


def make_collate(student: Any, teacher: Any | None) -> Callable[[list[dict[str, Any]]], Any]:
    """Tokenize a batch with the student's tokenizer (and the teacher's, when online)."""

    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        texts = [it["text"] for it in items]
        batch: dict[str, Any] = {
            "features": tokenize(student, texts),
            "index": torch.tensor([it["index"] for it in items]),
        }
        if "teacher" in items[0]:
            batch["teacher"] = torch.stack([it["teacher"] for it in items])
        elif teacher is not None:
            batch["teacher_features"] = tokenize(teacher, texts)
        return batch

    return collate


def online_step(teacher: Any) -> Callable[[nn.Module, dict[str, Any]], Any]:
    """The step without a cache: the frozen teacher embeds the batch first."""

    def step(model: nn.Module, batch: dict[str, Any]) -> Any:
        with torch.no_grad():
            batch["teacher"] = teacher(dict(batch["teacher_features"]))["sentence_embedding"]
        return model(batch)

    return step


# ---- build --------------------------------------------------------------------------------
def _check(config: TrainConfig) -> None:
    r, m = config.recipe, config.model
    _require()
    if not r["train_data"]:
        raise ConfigError(
            "recipe.train_data: not set; allowed: --train_data PATH (a text file "
            "with one text per line, .jsonl, .parquet or a dataset folder)"
        )
    if r["teacher_dtype"] not in DTYPES:
        raise ConfigError(
            f"recipe.teacher_dtype: {r['teacher_dtype']!r}; allowed: " + ", ".join(DTYPES)
        )
    ml = m["max_seq_length"]
    if ml is not None and (not isinstance(ml, int) or isinstance(ml, bool) or ml < 1):
        raise ConfigError(f"model.max_seq_length: {ml!r}; allowed: an integer >= 1 or null")
    for key in ("teacher_batch_size", "n_anchors"):
        if r[key] < 1:
            raise ConfigError(f"recipe.{key}: {r[key]!r}; allowed: an integer >= 1")
    if not r["recall_at"] or not all(isinstance(k, int) and k >= 1 for k in r["recall_at"]):
        raise ConfigError(f"recipe.recall_at: {r['recall_at']!r}; allowed: integers >= 1")


def rows_needed(config: TrainConfig, n: int) -> int:
    """Texts the phases that run will read; a cap above the corpus is said, once."""
    need = 0
    for i, phase in enumerate(config.phases or []):
        if phase.skip:
            continue
        cap = phase.max_samples
        if cap is not None and cap > n:
            log.info(
                "%s: max_samples %d is above the corpus size %d; the phase reads all "
                "%d texts each epoch",
                phase.name or f"phase{i + 1}",
                cap,
                n,
                n,
            )
        need = max(need, n if cap is None else min(cap, n))
    return need or n


def run_dir(config: TrainConfig) -> Path | None:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else None


class _Teacher:
    """The frozen teacher, loaded on first use: a run whose embeddings are all cached
    (a resumed one) never loads it."""

    def __init__(self, config: TrainConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.model: Any = None

    def get(self) -> Any:
        r = self.config.recipe
        if self.model is None:
            t0 = time.perf_counter()
            self.model = load_st(r["teacher_model"], self.config, r["teacher_dtype"]).to(
                self.device
            )
            self.model.eval().requires_grad_(False)
            log.info(
                "teacher %r loaded in %.2f s (%s)",
                r["teacher_model"],
                time.perf_counter() - t0,
                r["teacher_dtype"],
            )
        return self.model

    def encode(self, texts: list[str]) -> torch.Tensor:
        return self.get().encode(
            texts,
            batch_size=self.config.recipe["teacher_batch_size"],
            convert_to_tensor=True,
            show_progress_bar=False,
        )


def build(config: TrainConfig) -> Built:
    r = config.recipe
    _check(config)
    import transformers

    transformers.logging.disable_progress_bar()  # one "Loading weights" bar per rank otherwise
    ctx = ddp.get_context()
    device = ctx.device if ctx is not None else torch.device("cpu")
    train = read_corpus(r["train_data"], r["text_field"], "--train_data")
    val = (
        read_corpus(r["val_data"], r["text_field"], "--val_data", pairs_allowed=True)
        if r["val_data"]
        else None
    )
    rows = rows_needed(config, len(train.texts))
    train.texts = train.texts[:rows]  # the Trainer reads the first max_samples of the data

    teacher = _Teacher(config, device)
    cache_dir = run_dir(config)
    cache_dir = cache_dir / "teacher_cache" if cache_dir is not None else None

    def key(c: Any) -> dict[str, Any]:
        return cache_key(r["teacher_model"], r["teacher_dtype"], config.model["max_seq_length"], c)

    t_train = None
    if r["teacher_cache"]:
        t_train = teacher_embeddings(cache_dir, "train", key(train), train.texts, teacher.encode)
        teacher_dim = int(t_train.shape[1])
    else:
        teacher_dim = _width(teacher.get())
        log.info("teacher cache off: the teacher embeds every batch")
    t_val = None
    if val is not None:  # evaluation reads teacher embeddings of the held-out texts
        t_val = teacher_embeddings(cache_dir, "val", key(val), val.texts, teacher.encode)
    if r["teacher_cache"]:
        teacher.model = None  # cached: free the teacher's memory before training
    model = make_student(config, teacher_dim)
    log.info(
        "distill: teacher %r (width %d) -> student %r, %s, %d training texts%s",
        r["teacher_model"],
        teacher_dim,
        r["student_model"],
        "projection" if model.use_projection else f"MRL {model.mrl_dims}",
        len(train.texts),
        f", {len(val.texts)} held-out" if val else "",
    )
    train_set = TextSet(train.texts, t_train)
    val_set = TextSet(val.texts, t_val, val.positives) if val is not None else None
    collate = make_collate(model.st, None if r["teacher_cache"] else teacher.get())
    step = None if r["teacher_cache"] else online_step(teacher.get())
    eval_fn = (
        make_eval_fn(val_set, r["n_anchors"], list(r["recall_at"]), config.training.batch_size)
        if val_set is not None
        else None
    )
    return Built(model, train_set, val_set, step, eval_fn, collate, after_fit=_after_fit(config))


# ---- export -------------------------------------------------------------------------------
def artifacts_path(config: TrainConfig) -> Path:
    """``--artifacts_dir``; a relative one lands in the run directory, not the cwd."""
    out = Path(config.recipe["artifacts_dir"])
    base = run_dir(config)
    return out if out.is_absolute() or base is None else base / out


def save_st(st: Any, dest: Path) -> Path:
    """``st.save`` into ``dest`` via a sibling temp folder: never a half-written export."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    st.save(str(tmp))
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def _after_fit(config: TrainConfig) -> Callable[[Any, dict[str, Any]], None]:
    """Rank 0 writes the SentenceTransformer folder(s) once training ended normally
    (``python -m ddp`` calls this only then), so a failed run exports nothing."""

    def export(trainer: Any, summary: dict[str, Any]) -> None:
        if not ddp.is_main_process():
            return
        model = ddp.unwrap(trainer.wrapped)
        st = model.st
        dests = []
        if (root := run_dir(config)) is not None:
            dests.append(root / "final" / "sentence_transformer")
        if config.recipe["save_to_artifacts"]:
            dests.append(artifacts_path(config))
        for dest in dests:
            try:
                save_st(st, dest)
            except OSError as exc:
                raise ConfigError(f"export to {dest}: {exc.strerror or exc}") from None
            log.info(
                "saved SentenceTransformer to %s (embedding width %d; load with "
                "SentenceTransformer(%r))",
                dest,
                _width(st),
                str(dest),
            )

    return export
