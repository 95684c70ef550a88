"""Graph classification with a message-passing GNN in plain torch (seed 002).

No torch_geometric: a batch of graphs is one block-diagonal graph (node features,
an edge list, and the graph id of every node), messages are summed with
``index_add_`` and graphs are read out by mean and max pooling per graph id.

Data are generated at build time from ``recipe.data_seed``: graphs of
``min_nodes..max_nodes`` nodes and about the same mean degree in three classes
that differ only in structure:

* 0: Erdos-Renyi (Poisson degrees);
* 1: preferential attachment (a few hubs, heavy-tailed degrees);
* 2: ring lattice with a few rewired edges (almost regular, high clustering).

Node features are constant, so the model must read the class from the wiring.
What the seed guide describes and where it lives here:

* single-device Apple MPS: ``python -m ddp gnn`` on a Mac picks ``mps`` by itself
  (device auto: cuda, xpu, mps, cpu); several ranks on a Mac run on the CPU with a
  warning (Gloo cannot carry MPS tensors);
* metric aggregation: the eval step returns per-graph means and the Trainer sums
  ``mean * n`` and ``n`` over an unpadded shard per rank with one ``reduce_sum``,
  so ``eval_acc`` is the exact accuracy over all held-out graphs, not an average
  of per-rank averages;
* checkpoint barrier: the Trainer's checkpoint save is collective (rank 0 writes,
  then ``ddp.barrier()``), so no rank runs ahead of a checkpoint in progress.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from ddp.config import TrainConfig
from ddp.errors import ConfigError
from ddp.recipes import Built, Flag, seeded_model

log = logging.getLogger("ddp")

NAME = "gnn"
DESCRIPTION = "GNN graph classification (plain-torch message passing) on generated graphs"
N_CLASSES = 3

DEFAULTS: dict[str, Any] = {
    "training": {"batch_size": 32, "epochs": 10, "seed": 0},
    "optim": {"name": "adamw", "lr": 3e-3, "weight_decay": 1e-4, "schedule": "cosine",
              "grad_clip": 1.0},  # fmt: skip
    "checkpoint": {"dir": "checkpoints/gnn"},
    "logging": {"every_n_steps": 20},
    "model": {"hidden": 32, "layers": 3, "dropout": 0.0},
    "recipe": {"n_train": 768, "n_eval": 256, "min_nodes": 16, "max_nodes": 32,
               "mean_degree": 4, "data_seed": 1, "run_name": ""},  # fmt: skip
}

FLAGS = [
    Flag("--epochs", "training.epochs", int, "epochs"),
    Flag("--batch-size", "training.batch_size", int, "graphs per batch per rank"),
    Flag("--lr", "optim.lr", float, "learning rate (scaled by scaling.rule)"),
    Flag("--hidden", "model.hidden", int, "hidden width"),
    Flag("--layers", "model.layers", int, "message-passing layers"),
    Flag("--wandb-project", "logging.wandb.project", str, "W&B project (rank 0 logs only)"),
    Flag("--run-name", "recipe.run_name", str, "run name (recorded in the config)"),
]


# ---- data --------------------------------------------------------------------------------
def _undirected(edges: set[tuple[int, int]]) -> torch.Tensor:
    e = torch.tensor(sorted(edges), dtype=torch.long).T if edges else torch.zeros(2, 0).long()
    return torch.cat([e, e.flip(0)], 1)  # both directions: messages flow both ways


def make_graph(cls: int, n: int, degree: int, g: torch.Generator) -> torch.Tensor:
    """Edge index (2, E) of one graph of class ``cls`` with ``n`` nodes."""
    edges: set[tuple[int, int]] = set()

    def add(a: int, b: int) -> None:
        if a != b:
            edges.add((min(a, b), max(a, b)))

    if cls == 0:  # Erdos-Renyi with mean degree `degree`
        p = degree / (n - 1)
        upper = torch.triu(torch.rand(n, n, generator=g) < p, 1).nonzero().tolist()
        edges.update((a, b) for a, b in upper)
    elif cls == 1:  # preferential attachment: each new node links to degree/2 others
        m = max(1, degree // 2)
        targets = list(range(m + 1))
        for a in range(m + 1):
            for b in range(a + 1, m + 1):
                add(a, b)
        for v in range(m + 1, n):
            picks: set[int] = set()
            while len(picks) < m:
                picks.add(targets[int(torch.randint(len(targets), (1,), generator=g))])
            for u in picks:
                add(v, u)
                targets += [u, v]
    else:  # ring lattice (each node to degree/2 neighbours per side), 10% rewired
        half = max(1, degree // 2)
        for v in range(n):
            for d in range(1, half + 1):
                if float(torch.rand(1, generator=g)) < 0.1:
                    add(v, int(torch.randint(n, (1,), generator=g)))
                else:
                    add(v, (v + d) % n)
    return _undirected(edges)


class GraphDataset(Dataset):
    """Generated graphs: (edge_index, n_nodes, label) per item, deterministic per seed."""

    def __init__(self, n: int, min_nodes: int, max_nodes: int, degree: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(n) % N_CLASSES  # balanced: majority baseline = 1/3
        self.labels = self.labels[torch.randperm(n, generator=g)]
        self.sizes = torch.randint(min_nodes, max_nodes + 1, (n,), generator=g)
        self.edges = [make_graph(int(c), int(s), degree, g)
                      for c, s in zip(self.labels, self.sizes, strict=True)]  # fmt: skip

    def __len__(self) -> int:
        return len(self.edges)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        return self.edges[i], int(self.sizes[i]), int(self.labels[i])


def collate(items: list[tuple[torch.Tensor, int, int]]) -> dict[str, torch.Tensor]:
    """Many graphs -> one block-diagonal graph with a node -> graph index."""
    edges, batch, offset = [], [], 0
    for gi, (e, n, _) in enumerate(items):
        edges.append(e + offset)
        batch.append(torch.full((n,), gi, dtype=torch.long))
        offset += n
    return {  # "y" first: the Trainer counts samples by the first value's leading dim
        "y": torch.tensor([c for _, _, c in items], dtype=torch.long),
        "edge_index": torch.cat(edges, 1),
        "batch": torch.cat(batch),
    }


# ---- model -------------------------------------------------------------------------------
class GINLayer(nn.Module):
    """GIN-style update: h' = MLP(h + sum of neighbour h) (as expressive as 1-WL)."""

    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim), nn.GELU(),
                                 nn.Dropout(dropout), nn.Linear(dim, dim))  # fmt: skip

    def forward(self, h: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        agg = torch.zeros_like(h).index_add_(0, dst, h[src])
        return h + self.mlp(h + agg)


class GNN(nn.Module):
    """Constant node input + degree scaling, GIN layers, mean+max graph readout."""

    def __init__(self, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(2, hidden)
        self.layers = nn.ModuleList(GINLayer(hidden, dropout) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.GELU(),
                                  nn.Linear(hidden, N_CLASSES))  # fmt: skip

    def logits(self, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        n = batch.shape[0]
        n_graphs = int(batch.max()) + 1
        deg = torch.zeros(n, device=batch.device).index_add_(
            0, edge_index[1], torch.ones(edge_index.shape[1], device=batch.device)
        )
        # Features: a constant and the log degree (what any GNN computes in one layer).
        h = self.inp(torch.stack([torch.ones_like(deg), torch.log1p(deg)], 1))
        for layer in self.layers:
            h = layer(h, edge_index)
        count = torch.zeros(n_graphs, device=h.device).index_add_(0, batch, torch.ones_like(deg))
        mean = torch.zeros(n_graphs, h.shape[1], device=h.device).index_add_(0, batch, h)
        mean = mean / count[:, None]
        mx = torch.full_like(mean, float("-inf")).scatter_reduce(
            0, batch[:, None].expand_as(h), h, "amax"
        )
        return self.head(torch.cat([mean, mx], 1))

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = self.logits(data["edge_index"], data["batch"]).float()
        return {
            "loss": F.cross_entropy(logits, data["y"]),
            "acc": (logits.argmax(1) == data["y"]).float().mean(),
        }


# ---- build -------------------------------------------------------------------------------
def datasets(config: TrainConfig) -> tuple[GraphDataset, GraphDataset]:
    r = config.recipe
    if not 3 <= r["min_nodes"] <= r["max_nodes"]:
        raise ConfigError(f"recipe.min_nodes/max_nodes: {r['min_nodes']}..{r['max_nodes']}; "
                          "expected 3 <= min_nodes <= max_nodes")  # fmt: skip
    if not 2 <= r["mean_degree"] < r["min_nodes"]:
        raise ConfigError(f"recipe.mean_degree: {r['mean_degree']!r}; expected 2 <= degree "
                          f"< min_nodes ({r['min_nodes']})")  # fmt: skip
    args = (r["min_nodes"], r["max_nodes"], r["mean_degree"])
    seed = int(r["data_seed"])
    return GraphDataset(r["n_train"], *args, seed), GraphDataset(r["n_eval"], *args, seed + 1)


def make_model(config: TrainConfig) -> GNN:
    m = config.model
    if m["hidden"] < 1 or m["layers"] < 1:
        raise ConfigError(f"model.hidden/layers: {m['hidden']}/{m['layers']}; expected >= 1")
    return seeded_model(config.training.seed, lambda: GNN(m["hidden"], m["layers"], m["dropout"]))


@torch.no_grad()
def accuracy(model: GNN, data: GraphDataset) -> float:
    """Single-process accuracy over a whole dataset (tests, notebooks)."""
    batch = collate([data[i] for i in range(len(data))])
    model.eval()
    return float((model.logits(batch["edge_index"], batch["batch"]).argmax(1) == batch["y"])
                 .float().mean())  # fmt: skip


def eval_fn(model: nn.Module, data: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per-graph means plus ``n`` = graphs in the batch: the Trainer sums mean * n and n."""
    out = model(data)
    return {"loss": out["loss"], "acc": out["acc"], "n": data["y"].shape[0]}


def build(config: TrainConfig) -> Built:
    model = make_model(config)
    train, evals = datasets(config)
    return Built(model, train, evals, None, eval_fn, collate)
