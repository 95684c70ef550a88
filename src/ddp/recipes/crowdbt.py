"""Crowd-BT pairwise quality scorer (seed 003): Bradley-Terry with annotator reliability.

Each training sample is one crowd judgement "annotator k says image i beats image j".
A backbone scores every image (s = head(f(x))): a real EfficientNet-B0..B7, ResNet or
ViT by name (:mod:`ddp.recipes.backbones`: torchvision, timm or efficientnet_pytorch,
whichever imports; said once in the log), or ``tiny_cnn`` for the generated quick-start
data; annotator k agrees with the true
Bradley-Terry order with probability eta_k (Chen et al., "Pairwise ranking
aggregation in a crowdsourced setting", WSDM 2013)::

    P(k says i > j) = eta_k * sigmoid(s_i - s_j) + (1 - eta_k) * sigmoid(s_j - s_i)

eta_k = sigmoid(a_k) is learned with the backbone, so a careless annotator
(eta ~ 0.5) or an adversarial one (eta << 0.5) stops pulling the scores the wrong
way. a_k starts at ``model.eta_init`` > 0.5, which fixes the sign symmetry of the
likelihood (flipping every score and every eta gives the same value).

The user's data: ``--data-dir DIR`` (or ``s3://bucket/prefix`` with ``--data-source
s3``) holding RGB images and ``judgements.csv`` (``left,right,annotator,label``) or
``judgements.jsonl`` (:mod:`ddp.recipes.images`); ``recipe.eval_fraction`` of the
judgements are held out, and evaluation reports their NLL and ``agree`` (the share the
scores order as the crowd label says). Images are resized to the backbone's own input
size (300/380/456 for B3/B4/B5) unless ``--input-size`` says otherwise, and normalised
with ImageNet's mean and std, as the backbones' own preprocessing does.

Without ``--data-dir`` the data are generated at build time from ``recipe.data_seed``
(no download): gray (three equal channels) ``input_size`` x ``input_size`` images whose true quality q in [0, 1] sets how much
white noise covers a smooth pattern (q = 1 clean, q = 0 noisy), and comparisons
from ``recipe.annotators`` (each an eta: 0.9 = good, 0.5 = random, 0.1 = adversarial)
drawn from the BT model on q. Evaluation uses held-out images: ``eval_order_acc``
is the share of held-out pairs the scores order like the true quality (summed
exactly over ranks by the Trainer); :func:`spearman` compares scores with q.

Seed flags kept: ``--epochs --batch-size --lr --weight-decay --num-workers
--backbone --input-size --data-source --distributed --world-size --local_rank``; added:
``--data-dir`` and ``--pretrained [PATH]``.
The launcher decides the world size: ``--distributed`` is accepted and ignored,
``--world-size N`` is checked against the ranks really started.
"""

from __future__ import annotations

import logging
import math
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from ddp.config import TrainConfig
from ddp.errors import ConfigError
from ddp.recipes import Built, Flag, backbones, images, seeded_model

log = logging.getLogger("ddp")

NAME = "crowdbt"
DESCRIPTION = "Crowd-BT quality scorer: EfficientNet/ResNet/ViT + per-annotator reliability"

BACKBONES = ("tiny_cnn", *backbones.NAMES)
TINY_SIZE = 16  # tiny_cnn's input size when model.input_size is 0
ETA_GAIN = 20.0

DEFAULTS: dict[str, Any] = {
    "training": {"batch_size": 16, "epochs": 20, "seed": 0},
    "optim": {
        "name": "adamw",
        "lr": 1e-4,
        "weight_decay": 0.0,
        "warmup_steps": 0,
        "schedule": "cosine",
        "grad_clip": 5.0,
    },
    "checkpoint": {"dir": "checkpoints/crowdbt"},
    "logging": {"every_n_steps": 20},
    "data": {"pin_memory": True},  # the seed's loaders pin; build() turns it off without CUDA
    "model": {
        "backbone": "tiny_cnn",
        "input_size": 0,
        "channels": 16,
        "eta_init": 0.8,
        "pretrained": "",
    },
    "recipe": {
        "data_source": "auto",
        "data_dir": "",
        "eval_fraction": 0.1,
        "max_cache_mb": 16384.0,
        "n_images": 512,
        "n_eval_images": 128,
        "n_pairs": 4096,
        "n_eval_pairs": 1024,
        "annotators": [0.9, 0.9, 0.85, 0.8, 0.5, 0.1],
        "bt_scale": 8.0,
        "data_seed": 1,
        "distributed": False,
        "world_size": 0,
        "local_rank": -1,
    },
}

FLAGS = [
    Flag("--epochs", "training.epochs", int, "epochs"),
    Flag("--batch-size", "training.batch_size", int, "batch size per GPU (per rank)"),
    Flag("--lr", "optim.lr", float, "learning rate (scaled by scaling.rule)"),
    Flag("--weight-decay", "optim.weight_decay", float, "AdamW weight decay"),
    Flag("--num-workers", "data.num_workers", int, "DataLoader workers per rank"),
    Flag(
        "--backbone",
        "model.backbone",
        str,
        "efficientnet_b0..b7, resnet18..152, vit_b_16/b_32/l_16/l_32, or tiny_cnn",
    ),
    Flag("--input-size", "model.input_size", int, "image side in pixels (0: the backbone's own)"),
    Flag(
        "--data-source",
        "recipe.data_source",
        str,
        "auto (s3:// or a folder; generated without --data-dir), local, s3, synthetic",
    ),
    Flag("--data-dir", "recipe.data_dir", str, "folder or s3://bucket/prefix: images + judgements"),
    Flag(
        "--pretrained",
        "model.pretrained",
        str,
        "the library's cached weights; --pretrained PATH: that file",
        const="cache",
    ),
    Flag("--distributed", "recipe.distributed", bool, "accepted; the launcher decides"),
    Flag("--world-size", "recipe.world_size", int, "checked against the launched ranks"),
    Flag("--local_rank", "recipe.local_rank", int, "set by torch.distributed.launch; unused"),
    Flag("--local-rank", "recipe.local_rank", int, "set by torch.distributed.launch; unused"),
]


# ---- data --------------------------------------------------------------------------------
def make_images(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (n, 3, size, size) and their true quality q in [0, 1].

    A smooth pattern (sum of a few Gaussian blobs) plus white noise of std
    ``0.8 * (1 - q)``: the quality is a function of the pixels that a CNN can read
    from high-frequency energy, and brightness or blob layout carry no signal.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(n, generator=g)
    ax = torch.linspace(-1, 1, size)
    yy, xx = torch.meshgrid(ax, ax, indexing="ij")
    centres = torch.rand(n, 3, 2, generator=g) * 1.6 - 0.8
    widths = torch.rand(n, 3, generator=g) * 0.3 + 0.2
    d2 = (xx[None, None] - centres[..., 0, None, None]) ** 2 + (
        yy[None, None] - centres[..., 1, None, None]
    ) ** 2
    pattern = torch.exp(-d2 / (2 * widths[..., None, None] ** 2)).sum(1)
    pattern = pattern / pattern.amax((1, 2), keepdim=True)
    noise = torch.randn(n, size, size, generator=g) * 0.8 * (1 - q)[:, None, None]
    return (pattern + noise).unsqueeze(1).expand(-1, 3, -1, -1).contiguous(), q


def make_pairs(
    q: torch.Tensor, n_pairs: int, etas: list[float], scale: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Crowd judgements (i, j, annotator, label) drawn from the Crowd-BT model on q."""
    g = torch.Generator().manual_seed(seed)
    n = q.shape[0]
    i = torch.randint(0, n, (n_pairs,), generator=g)
    j = (i + torch.randint(1, n, (n_pairs,), generator=g)) % n  # j != i
    k = torch.randint(0, len(etas), (n_pairs,), generator=g)
    eta = torch.tensor(etas, dtype=torch.float)[k]
    p_true = torch.sigmoid(scale * (q[i] - q[j]))
    p = eta * p_true + (1 - eta) * (1 - p_true)
    y = (torch.rand(n_pairs, generator=g) < p).float()
    return i, j, k, y


class PairDataset(Dataset):
    """Judgements indexing into one image tensor (images are not copied per pair)."""

    def __init__(
        self,
        images: torch.Tensor,
        i: torch.Tensor,
        j: torch.Tensor,
        k: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        self.images, self.i, self.j, self.k, self.y = images, i, j, k, y

    def __len__(self) -> int:
        return self.i.shape[0]

    def __getitem__(self, n: int) -> dict[str, torch.Tensor]:
        return {
            "a": self.images[self.i[n]],
            "b": self.images[self.j[n]],
            "annotator": self.k[n],
            "label": self.y[n],
        }


# ---- model -------------------------------------------------------------------------------
def tiny_cnn(channels: int) -> backbones.Backbone:
    """Two conv blocks for the generated quick-start data (no library needed)."""
    c = channels
    blocks = nn.ModuleList(
        [
            nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.GELU()),
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GELU()),
        ]
    )
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, c), nn.GELU())
    net = nn.ModuleDict({"blocks": blocks, "head": head})
    return backbones.Backbone(net, list(blocks), c, lambda x: x, head)


class CrowdBT(nn.Module):
    """A backbone and a linear score head, plus one reliability logit per annotator."""

    def __init__(self, n_annotators: int, backbone: nn.Module, dim: int, eta_init: float) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(dim, 1)
        # eta_logit = ETA_GAIN * eta_raw: Adam moves each parameter by about lr per step
        # whatever its gradient, and one annotator's logit gets only its share of the
        # batch; the gain lets reliabilities settle as fast as the backbone learns.
        logit = math.log(eta_init / (1 - eta_init))
        self.eta_raw = nn.Parameter(torch.full((n_annotators,), logit / ETA_GAIN))

    @property
    def gradient_checkpointing(self) -> bool:
        """``memory.gradient_checkpointing``: the backbone recomputes each block in backward."""
        return bool(getattr(self.backbone, "gradient_checkpointing", False))

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        # any backbone (EfficientNet, timm, torchvision): a plain attribute it reads or not
        cast(Any, self.backbone).gradient_checkpointing = value

    def score(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images)).squeeze(-1)

    @property
    def eta_logit(self) -> torch.Tensor:
        return ETA_GAIN * self.eta_raw

    @property
    def eta(self) -> torch.Tensor:
        """P(annotator agrees with the true order), one value per annotator."""
        return torch.sigmoid(self.eta_logit)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        b = batch["a"].shape[0]
        s = self.score(torch.cat([batch["a"], batch["b"]])).float()  # one backbone pass
        diff = s[:b] - s[b:]
        logit = self.eta_logit.float()[batch["annotator"]]
        log_eta, log_not = F.logsigmoid(logit), F.logsigmoid(-logit)
        # log P(label=1) = log(eta*sig(d) + (1-eta)*sig(-d)), computed in log space
        lp1 = torch.logaddexp(log_eta + F.logsigmoid(diff), log_not + F.logsigmoid(-diff))
        lp0 = torch.logaddexp(log_eta + F.logsigmoid(-diff), log_not + F.logsigmoid(diff))
        y = batch["label"].float()
        nll = -(y * lp1 + (1 - y) * lp0)
        return {"loss": nll.mean(), "raw_agree": ((diff > 0).float() == y).float().mean()}


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation (no ties expected: continuous values)."""
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def eval_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Held-out pairs: NLL of the crowd labels, agreement with them, and (generated data
    only, where the truth is known) agreement with the true order."""
    out = model(batch)
    metrics = {"loss": out["loss"], "agree": out["raw_agree"]}
    if "true" in batch:
        b = batch["a"].shape[0]
        s = cast(CrowdBT, model).score(torch.cat([batch["a"], batch["b"]])).float()
        metrics["order_acc"] = ((s[:b] > s[b:]) == (batch["true"] > 0.5)).float().mean()
    return metrics


class EvalPairs(PairDataset):
    """Held-out pairs that also carry the true order (1 if q_i > q_j)."""

    def __init__(self, images: torch.Tensor, q: torch.Tensor, *pairs: torch.Tensor) -> None:
        super().__init__(images, *pairs)
        self.true = (q[self.i] > q[self.j]).float()

    def __getitem__(self, n: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(n)
        item["true"] = self.true[n]
        return item


# ---- build -------------------------------------------------------------------------------
def image_size(config: TrainConfig) -> int:
    """``model.input_size``, or the backbone's own when it is 0."""
    m = config.model
    if m["input_size"]:
        return int(m["input_size"])
    return TINY_SIZE if m["backbone"] == "tiny_cnn" else backbones.input_size(m["backbone"])


def datasets(config: TrainConfig) -> tuple[PairDataset, EvalPairs, torch.Tensor, torch.Tensor]:
    """Generated data: train judgements, held-out judgements, held-out images, true quality."""
    r = config.recipe
    etas = [float(e) for e in r["annotators"]]
    if not etas or not all(0 <= e <= 1 for e in etas):
        raise ConfigError(f"recipe.annotators: {r['annotators']!r}; expected etas in [0, 1]")
    seed, size = int(r["data_seed"]), image_size(config)
    imgs, q = make_images(r["n_images"], size, seed)
    train = PairDataset(imgs, *make_pairs(q, r["n_pairs"], etas, r["bt_scale"], seed + 1))
    eimgs, eq = make_images(r["n_eval_images"], size, seed + 2)
    evals = EvalPairs(eimgs, eq, *make_pairs(eq, r["n_eval_pairs"], etas, r["bt_scale"], seed + 3))
    return train, evals, eimgs, eq


def user_datasets(config: TrainConfig) -> tuple[images.Judgements, images.Judgements | None, int]:
    """The user's judgements and images (:mod:`ddp.recipes.images`): train, held-out, and
    the number of annotators."""
    r = config.recipe
    if not 0 <= r["eval_fraction"] < 1:
        raise ConfigError(f"recipe.eval_fraction: {r['eval_fraction']!r}; expected [0, 1)")
    src = images.source(r["data_dir"], r["data_source"])
    raw = images.read_judgements(src)
    # EfficientNet and ViT preprocess with bicubic resizing, the ResNets and tiny_cnn bilinear
    resample = "bilinear" if config.model["backbone"].startswith(("resnet", "tiny")) else "bicubic"
    pixels = images.load_images(src, raw.images, image_size(config), r["max_cache_mb"], resample)
    mean, std = (backbones.MEAN, backbones.STD)
    tr, ev = images.split(raw, r["eval_fraction"], int(r["data_seed"]))
    train = images.Judgements(pixels, *images.subset(raw, tr), mean, std)
    evals = images.Judgements(pixels, *images.subset(raw, ev), mean, std) if len(ev) else None
    return train, evals, len(raw.annotators)


def make_model(config: TrainConfig, n_annotators: int | None = None) -> CrowdBT:
    m = config.model
    n = len(config.recipe["annotators"]) if n_annotators is None else n_annotators

    def make() -> CrowdBT:
        if m["backbone"] == "tiny_cnn":
            if m["pretrained"]:
                raise ConfigError(
                    "model.pretrained: tiny_cnn has no pretrained weights; "
                    "allowed: a library backbone (--backbone efficientnet_b3)"
                )
            net = tiny_cnn(m["channels"])
        else:
            net = backbones.build(m["backbone"], image_size(config), m["pretrained"])
        return CrowdBT(n, net, net.dim, m["eta_init"])

    return seeded_model(config.training.seed, make)


def data_kind(config: TrainConfig) -> str:
    """synthetic, local or s3: what ``recipe.data_source`` and ``recipe.data_dir`` say."""
    r = config.recipe
    src, d = r["data_source"], r["data_dir"]
    allowed = ("auto", "synthetic", "local", "s3")
    if src not in allowed:
        raise ConfigError(
            f"recipe.data_source: {src!r} is not allowed; allowed: " + ", ".join(allowed)
        )
    if src == "synthetic" or (src == "auto" and not d):
        return "synthetic"
    if not d:
        raise ConfigError(
            f"recipe.data_dir: --data-source {src} needs --data-dir "
            "(a folder or s3://bucket/prefix)"
        )
    return "s3" if src == "s3" or (src == "auto" and d.startswith("s3://")) else "local"


def build(config: TrainConfig) -> Built:
    import ddp

    m, r = config.model, config.recipe
    if m["backbone"] != "tiny_cnn":  # one line: the allowed names, or what to install
        backbones.check_name(m["backbone"])
    if not 0.5 < m["eta_init"] < 1:
        raise ConfigError(f"model.eta_init: {m['eta_init']!r}; expected (0.5, 1)")
    if m["input_size"] and not 4 <= m["input_size"] <= 4096:
        raise ConfigError(
            f"model.input_size: {m['input_size']!r}; expected 0 (the backbone's "
            "own) or an integer in [4, 4096]"
        )
    world = ddp.get_world_size()
    if r["world_size"] and r["world_size"] != world:
        raise ConfigError(
            f"recipe.world_size: --world-size {r['world_size']} but the launcher "
            f"started {world} rank(s); allowed: {world} or leave it out"
        )
    if r["distributed"] and world == 1:
        log.info(
            "crowdbt: --distributed given but one process runs; start ranks with "
            "torchrun/srun/mpiexec (hpc run) to train on several devices"
        )
    if config.data.pin_memory and not torch.cuda.is_available():
        config.data.pin_memory = False  # pinned host memory only speeds up copies to CUDA
    if data_kind(config) == "synthetic":
        if r["data_dir"]:
            raise ConfigError(
                "recipe.data_dir: given with --data-source synthetic; allowed: one of them"
            )
        train, evals, _, _ = datasets(config)
        return Built(make_model(config), train, evals, None, eval_fn)
    utrain, uevals, n_annotators = user_datasets(config)
    return Built(make_model(config, n_annotators), utrain, uevals, None, eval_fn)
