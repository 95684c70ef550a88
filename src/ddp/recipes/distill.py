"""Teacher-to-student embedding distillation in two phases (seed 000).

The seed distils a large retriever (``infly/inf-retriever-v1-pro``) into
``all-mpnet-base-v2``. Nothing is downloaded here: the teacher is a fixed random
bag-of-words encoder built from ``recipe.teacher_seed`` and the student a smaller
one, both over token ids of generated "sentences" (topic-mixture token draws),
so the recipe runs anywhere in seconds and the whole DDP path is the real one.
``--teacher_model`` / ``--student_model`` are accepted and recorded in the
exported config; they select no hub weights (a log line says so).

The teacher is frozen, so its embeddings are computed once at build time (a
teacher cache, as large-scale distillation does too) and the trained module is
the student alone: the Trainer's ``final/model.pt`` is exactly what inference needs.

Two modes (``model.use_projection``):

* projection: a linear head maps the student dim to the teacher dim and the loss
  is ``1 - cos(head(student), teacher)``;
* MRL (Matryoshka, ``--use_projection=False``): no head; for every prefix size m
  in ``model.mrl_dims`` the in-batch cosine-similarity matrix of the first m student
  dims is pulled towards the teacher's (MSE), so truncated embeddings stay usable.

Phases map onto the Trainer's ``phases:`` (own epochs, LR, sample cap, skip; a
fresh optimizer each). ``--save_to_artifacts`` writes an inference export to
``--artifacts_dir`` once training ends: plain torch (``model.pt`` + ``config.json``,
loaded by :func:`load_artifacts`) and, when sentence-transformers is installed,
also the SentenceTransformer layout (``modules.json``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from ddp.config import TrainConfig
from ddp.errors import ConfigError
from ddp.recipes import Built, Flag, seeded_model

log = logging.getLogger("ddp")

NAME = "distill"
DESCRIPTION = "embedding distillation: frozen teacher -> small student, 2 phases, proj or MRL"

DEFAULTS: dict[str, Any] = {
    "training": {"batch_size": 64, "epochs": 1, "seed": 0},
    "optim": {"name": "adamw", "lr": 5e-3, "weight_decay": 0.0, "schedule": "linear",
              "warmup_steps": 0, "grad_clip": 1.0},  # fmt: skip
    "phases": [
        {"name": "phase1", "epochs": 1, "lr": 1e-2, "max_samples": 1024},
        {"name": "phase2", "epochs": 3, "lr": 5e-3, "max_samples": 4096},
    ],
    "checkpoint": {"dir": "checkpoints/distill"},
    "logging": {"every_n_steps": 10},
    "model": {
        "vocab_size": 256, "max_len": 16,
        "teacher_dim": 64, "teacher_emb_dim": 16, "teacher_hidden": 128,
        "student_dim": 32, "student_hidden": 64,
        "use_projection": True, "mrl_dims": [8, 16, 32],
    },  # fmt: skip
    "recipe": {
        "teacher_model": "infly/inf-retriever-v1-pro",
        "student_model": "sentence-transformers/all-mpnet-base-v2",
        "n_train": 4096, "n_eval": 512, "n_topics": 8, "n_anchors": 32,
        "data_seed": 1, "teacher_seed": 7,
        "save_to_artifacts": False, "artifacts_dir": "./artifacts",
    },  # fmt: skip
}

FLAGS = [
    Flag("--teacher_model", "recipe.teacher_model", str, "teacher name (recorded; local tiny teacher)"),
    Flag("--student_model", "recipe.student_model", str, "student name (recorded; local tiny student)"),
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
    Flag("--save_to_artifacts", "recipe.save_to_artifacts", bool, "export for inference at the end"),
    Flag("--artifacts_dir", "recipe.artifacts_dir", str, "where --save_to_artifacts writes"),
]

PAD = 0


# ---- data --------------------------------------------------------------------------------
def make_sentences(n: int, vocab: int, max_len: int, n_topics: int, seed: int) -> torch.Tensor:
    """``n`` padded token rows: each sentence mixes one topic's preferred words with background.

    Topics give the teacher's embedding space real structure (near and far pairs),
    so similarity distillation has something to learn.
    """
    g = torch.Generator().manual_seed(seed)
    words = torch.arange(1, vocab)
    topic_words = torch.stack([words[torch.randperm(vocab - 1, generator=g)[:24]]
                               for _ in range(n_topics)])  # fmt: skip
    tokens = torch.full((n, max_len), PAD, dtype=torch.long)
    lengths = torch.randint(max(2, max_len // 3), max_len + 1, (n,), generator=g)
    topics = torch.randint(0, n_topics, (n,), generator=g)
    for i in range(n):
        L = int(lengths[i])
        from_topic = torch.rand(L, generator=g) < 0.7
        tw = topic_words[topics[i]][torch.randint(0, 24, (L,), generator=g)]
        bg = torch.randint(1, vocab, (L,), generator=g)
        tokens[i, :L] = torch.where(from_topic, tw, bg)
    return tokens


class Encoder(nn.Module):
    """Bag-of-words encoder: mean of token embeddings (padding masked), then an MLP."""

    def __init__(self, vocab: int, dim: int, hidden: int, out: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, out))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != PAD).unsqueeze(-1).to(self.emb.weight.dtype)
        pooled = (self.emb(tokens) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.mlp(pooled)


def make_teacher(m: dict[str, Any], seed: int) -> Encoder:
    """The fixed teacher: same weights on every rank and in every run with this seed."""

    def make() -> Encoder:
        t = Encoder(m["vocab_size"], m["teacher_emb_dim"], m["teacher_hidden"], m["teacher_dim"])
        nn.init.normal_(t.emb.weight, std=1.0)
        for layer in (t.mlp[0], t.mlp[2]):  # zero biases: similarities centred on 0
            nn.init.zeros_(layer.bias)
        return t

    return seeded_model(seed, make).requires_grad_(False).eval()


class DistillDataset(Dataset):
    """Token rows with their cached teacher embeddings."""

    def __init__(self, tokens: torch.Tensor, teacher: torch.Tensor) -> None:
        self.tokens, self.teacher = tokens, teacher

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[i], "teacher": self.teacher[i]}


# ---- student -----------------------------------------------------------------------------
class Student(nn.Module):
    """Student encoder, plus the projection head in projection mode.

    ``forward(batch)`` returns the training loss (so the Trainer's default step
    works); :meth:`encode` gives the inference embedding (student dim, no head,
    as the seed's saved SentenceTransformer would).
    """

    def __init__(self, m: dict[str, Any]) -> None:
        super().__init__()
        self.encoder = Encoder(m["vocab_size"], m["student_dim"], m["student_hidden"],
                               m["student_dim"])  # fmt: skip
        self.use_projection = bool(m["use_projection"])
        self.proj = nn.Linear(m["student_dim"], m["teacher_dim"]) if self.use_projection else None
        self.mrl_dims = [int(d) for d in m["mrl_dims"]]

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Inference embedding: the head's output (teacher space) or the MRL embedding."""
        s = self.encoder(tokens)
        return self.proj(s) if self.proj is not None else s

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s = self.encode(batch["tokens"]).float()
        t = batch["teacher"].float()
        if self.proj is not None:
            cos = F.cosine_similarity(s, t, dim=-1)
            return {"loss": (1 - cos).mean(), "cos": cos.mean().detach()}
        t_sim = _sim(t, t)
        losses = [F.mse_loss(_sim(s[:, :d], s[:, :d]), t_sim) for d in self.mrl_dims]
        return {"loss": torch.stack(losses).mean(), "mrl_full": losses[-1].detach()}


def _sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def _check(m: dict[str, Any]) -> None:
    dims = [int(d) for d in m["mrl_dims"]]
    if not dims or dims != sorted(dims) or dims[-1] > m["student_dim"] or dims[0] < 1:
        raise ConfigError(
            f"model.mrl_dims: {m['mrl_dims']!r}; expected increasing sizes in "
            f"[1, model.student_dim={m['student_dim']}]"
        )
    for k in ("vocab_size", "max_len", "teacher_dim", "student_dim"):
        if m[k] < 2:
            raise ConfigError(f"model.{k}: {m[k]!r}; expected an integer >= 2")


def make_eval_fn(anchors: DistillDataset) -> Any:
    """Per-sample metrics, so the Trainer's summed eval is exact across ranks.

    ``anchor_mse``: mean squared gap between the student's and the teacher's cosine
    similarity to a fixed set of anchor sentences (works in both modes; 0 = the
    student reproduces the teacher's geometry). ``cos``: cosine to the teacher
    through the projection head (projection mode only).
    """

    def eval_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dev = batch["tokens"].device
        s = model.encode(batch["tokens"]).float()
        s_anchor = model.encode(anchors.tokens.to(dev)).float()
        t = batch["teacher"].float()
        gap = (_sim(s, s_anchor) - _sim(t, anchors.teacher.to(dev).float())).pow(2).mean(1)
        out = model(batch)
        metrics = {"loss": out["loss"], "anchor_mse": gap.mean()}
        if model.proj is not None:
            metrics["cos"] = F.cosine_similarity(s, t, dim=-1).mean()
        return metrics

    return eval_fn


@torch.no_grad()
def score(model: nn.Module, data: DistillDataset, anchors: DistillDataset) -> dict[str, float]:
    """Single-process version of the eval metrics (tests, notebooks)."""
    was = model.training
    model.eval()
    out = make_eval_fn(anchors)(model, {"tokens": data.tokens, "teacher": data.teacher})
    model.train(was)
    return {k: float(v) for k, v in out.items()}


# ---- build -------------------------------------------------------------------------------
def datasets(config: TrainConfig) -> tuple[DistillDataset, DistillDataset, DistillDataset]:
    """Train, eval and anchor sets with cached teacher embeddings (deterministic)."""
    m, r = config.model, config.recipe
    n = r["n_train"] + r["n_eval"]
    tokens = make_sentences(n, m["vocab_size"], m["max_len"], r["n_topics"], r["data_seed"])
    teacher = make_teacher(m, r["teacher_seed"])
    with torch.no_grad():
        emb = torch.cat([teacher(chunk) for chunk in tokens.split(1024)])
    train = DistillDataset(tokens[: r["n_train"]], emb[: r["n_train"]])
    evals = DistillDataset(tokens[r["n_train"] :], emb[r["n_train"] :])
    k = min(r["n_anchors"], r["n_eval"])
    return train, evals, DistillDataset(evals.tokens[:k], evals.teacher[:k])


def make_student(config: TrainConfig) -> Student:
    return seeded_model(config.training.seed, lambda: Student(config.model))


def build(config: TrainConfig) -> Built:
    m, r = config.model, config.recipe
    _check(m)
    for key in ("n_train", "n_eval", "n_anchors"):
        if r[key] < 1:
            raise ConfigError(f"recipe.{key}: {r[key]!r}; expected an integer >= 1")
    log.info(
        "distill: teacher %r / student %r are not downloaded: local tiny teacher "
        "(dim %d) and student (dim %d), %s mode",
        r["teacher_model"], r["student_model"], m["teacher_dim"], m["student_dim"],
        "projection" if m["use_projection"] else f"MRL {m['mrl_dims']}",
    )  # fmt: skip
    train, evals, anchors = datasets(config)
    if r["save_to_artifacts"]:
        if not config.checkpoint.dir:
            raise ConfigError("recipe.save_to_artifacts: needs checkpoint.dir (the final export)")
    after = _after_fit(config) if r["save_to_artifacts"] else None
    return Built(make_student(config), train, evals, None, make_eval_fn(anchors), after_fit=after)


# ---- artifacts ---------------------------------------------------------------------------
def _after_fit(config: TrainConfig) -> Callable[[Any, dict[str, Any]], None]:
    """Rank 0 converts the Trainer's fresh ``final/model.pt`` into inference artifacts.

    Runs only after a normal end of training (``python -m ddp`` calls it), so a failed
    or preempted run exports nothing half-trained.
    """

    def export(trainer: Any, summary: dict[str, Any]) -> None:
        import ddp

        if not ddp.is_main_process():
            return
        final = Path(config.checkpoint.dir) / "final" / "model.pt"  # type: ignore[arg-type]
        path = export_artifacts(torch.load(final, weights_only=True), config,
                                config.recipe["artifacts_dir"])  # fmt: skip
        log.info("saved inference artifacts to %s", path)

    return export


def export_artifacts(state: dict[str, torch.Tensor], config: TrainConfig, out: str | Path) -> Path:
    """Write ``model.pt`` (student state dict) + ``config.json``; ST layout when available.

    Load with :func:`load_artifacts` (plain torch, nothing else needed).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": "ddp-distill-student/1",
        "model": dict(config.model),
        "teacher_model": config.recipe["teacher_model"],
        "student_model": config.recipe["student_model"],
        "embedding_dim": config.model["student_dim"],
        "pad_id": PAD,
    }
    torch.save({k: v.cpu() for k, v in state.items()}, out / "model.pt")
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return out
    _write_st_layout(out)
    return out


def load_artifacts(path: str | Path, device: str = "cpu") -> Student:
    """The exported student for inference: ``load_artifacts(d).encode(token_ids)``."""
    path = Path(path)
    meta = json.loads((path / "config.json").read_text())
    model = Student(meta["model"])
    model.load_state_dict(torch.load(path / "model.pt", map_location=device, weights_only=True))
    return model.to(device).eval()


class STStudent(nn.Module):
    """SentenceTransformer module wrapping the student (used only with that package).

    Input features are ``{"input_ids": LongTensor}`` of token ids (this toy student
    has no text tokenizer; :meth:`tokenize` accepts lists of ids).
    """

    def __init__(self, student: Student) -> None:
        super().__init__()
        self.student = student

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        features["sentence_embedding"] = self.student.encode(features["input_ids"])
        return features

    def tokenize(self, texts: list[list[int]], **_: Any) -> dict[str, torch.Tensor]:
        n = max(len(t) for t in texts)
        ids = torch.full((len(texts), n), PAD, dtype=torch.long)
        for i, t in enumerate(texts):
            ids[i, : len(t)] = torch.as_tensor(t, dtype=torch.long)
        return {"input_ids": ids}

    def get_sentence_embedding_dimension(self) -> int:
        return self.student.encode(torch.ones(1, 1, dtype=torch.long)).shape[-1]

    def save(self, output_path: str, *args: Any, **kwargs: Any) -> None:
        pass  # the weights live in the parent folder's model.pt

    @staticmethod
    def load(input_path: str, *args: Any, **kwargs: Any) -> STStudent:
        return STStudent(load_artifacts(Path(input_path).parent))


def _write_st_layout(out: Path) -> None:
    """``modules.json`` naming :class:`STStudent`, so ``SentenceTransformer(out)`` loads it."""
    (out / "st").mkdir(exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "st", "type": f"{__name__}.STStudent"}]
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "config_sentence_transformers.json").write_text(
        json.dumps({"__version__": {"pytorch": torch.__version__}}, indent=2) + "\n"
    )
