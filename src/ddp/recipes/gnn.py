"""Graph classification with a message-passing GNN in plain torch (seed 002).

The model is plain torch whatever the data's source: a batch of graphs is one
block-diagonal graph (node features, an edge list, edge features, and the graph id of
every node: PyG's ``Batch`` layout), messages are summed with ``index_add_`` and graphs
are read out by mean and max pooling per graph id. Each layer is GIN's update; with
edge features it is GINE's (Hu et al. 2020): the message from j to i is
``relu(h_j + W e_ji)``. So a run on PyG data and one on the library-free file give the
same model and the same results path; torch_geometric only reads data.

**The user's graphs** (``recipe.data`` / ``--data``; ``ddp.recipes.graphs`` documents
the formats and checks): a library-free ``.pt`` list of dicts (``edge_index``, ``x``,
optional ``edge_attr``, ``y``), a file PyG's ``InMemoryDataset.save`` wrote, or a
``torch_geometric.datasets`` class by name (``--pyg-dataset TUDataset:MUTAG --data
ROOT``; extra ``gnn``). Held-out graphs: ``--eval-data`` or a seeded
``recipe.eval_fraction`` of them. Classes: 0..max label. Node features (N, F) and edge
features (E, D) reach the model; graphs are batched whole, each rank takes its own
graphs of the epoch's order (no duplicates with the seed's ``drop_last``), and the
evaluation is exact (each rank an unpadded shard, sums all-reduced).

**Quick start** (no ``--data``): graphs generated at build time from ``recipe.data_seed``: graphs of
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
  then ``ddp.barrier()``), so no rank runs ahead of a checkpoint in progress;
* ``best_model.pt``: ``checkpoint.best: {metric: eval/loss, mode: min}`` (set in
  configs/gnn.yaml) keeps ``best/model.pt`` on each improvement, ``best_model.pt`` its
  alias (see ddp.checkpoint.manager.Checkpointer.keep_best);
* W&B: ``--wandb-project cricket-gnn --run-name NAME``; the run is named, ``epoch`` is
  in every record and ``logging.wandb.init_timeout`` is the seed's 120 s.
"""

from __future__ import annotations

import logging
from collections.abc import Sized
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from ddp.config import TrainConfig
from ddp.errors import ConfigError
from ddp.recipes import Built, Flag, graphs, seeded_model
from ddp.recipes.graphs import Graph, GraphList, collate

log = logging.getLogger("ddp")

NAME = "gnn"
DESCRIPTION = "GNN graph classification (GIN/GINE in plain torch) on your graphs or generated ones"
N_CLASSES = 3

DEFAULTS: dict[str, Any] = {
    # drop_last: seed 002's DistributedSampler(drop_last=True): every rank trains on
    # distinct graphs (no padded repeats); at most world-1 graphs an epoch go unseen.
    "training": {"batch_size": 32, "epochs": 10, "seed": 0, "drop_last": True},
    "optim": {
        "name": "adamw",
        "lr": 3e-3,
        "weight_decay": 1e-4,
        "schedule": "cosine",
        "grad_clip": 1.0,
    },
    "checkpoint": {"dir": "checkpoints/gnn"},
    "logging": {"every_n_steps": 20},
    "model": {"hidden": 32, "layers": 3, "dropout": 0.0},
    "recipe": {
        "n_train": 768,
        "n_eval": 256,
        "min_nodes": 16,
        "max_nodes": 32,
        "mean_degree": 4,
        "data_seed": 1,
        "run_name": "",
        "data": "",
        "eval_data": "",
        "pyg_dataset": "",
        "eval_fraction": 0.2,
    },
}

FLAGS = [
    Flag("--epochs", "training.epochs", int, "epochs"),
    Flag("--batch-size", "training.batch_size", int, "graphs per batch per rank"),
    Flag("--lr", "optim.lr", float, "learning rate (scaled by scaling.rule)"),
    Flag("--hidden", "model.hidden", int, "hidden width"),
    Flag("--layers", "model.layers", int, "message-passing layers"),
    Flag("--wandb-project", "logging.wandb.project", str, "W&B project (rank 0 logs only)"),
    Flag("--run-name", "recipe.run_name", str, "W&B run name (logging.wandb.name wins)"),
    Flag("--data", "recipe.data", str, "your graphs: a .pt file, or a PyG dataset's root"),
    Flag("--eval-data", "recipe.eval_data", str, "held-out graphs (else eval_fraction)"),
    Flag(
        "--pyg-dataset",
        "recipe.pyg_dataset",
        str,
        "a torch_geometric.datasets class on --data, e.g. TUDataset:MUTAG",
    ),
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
    """Generated graphs (no node or edge features), deterministic per seed."""

    def __init__(self, n: int, min_nodes: int, max_nodes: int, degree: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(n) % N_CLASSES  # balanced: majority baseline = 1/3
        self.labels = self.labels[torch.randperm(n, generator=g)]
        self.sizes = torch.randint(min_nodes, max_nodes + 1, (n,), generator=g)
        self.edges = [
            make_graph(int(c), int(s), degree, g)
            for c, s in zip(self.labels, self.sizes, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.edges)

    def __getitem__(self, i: int) -> Graph:
        return Graph(self.edges[i], int(self.sizes[i]), int(self.labels[i]))


# ---- model -------------------------------------------------------------------------------
class GINLayer(nn.Module):
    """GIN-style update: h' = MLP(h + sum of neighbour messages) (as expressive as 1-WL).

    The message from j is h_j; with ``edge_dim`` > 0 it is GINE's relu(h_j + W e_ji),
    so edge features shape what each neighbour contributes."""

    def __init__(self, dim: int, dropout: float, edge_dim: int = 0) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(dim, dim),
            nn.LayerNorm(dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(dim, dim),
        )
        self.edge = nn.Linear(edge_dim, dim) if edge_dim else None

    def forward(
        self, h: torch.Tensor, edge_index: torch.Tensor, edge_attr: torch.Tensor | None = None
    ) -> torch.Tensor:
        src, dst = edge_index
        msg = h[src]
        if self.edge is not None and edge_attr is not None:
            msg = F.relu(msg + self.edge(edge_attr.to(h.dtype)))
        agg = torch.zeros_like(h).index_add_(0, dst, msg)
        return h + self.mlp(h + agg)


class GNN(nn.Module):
    """Node input (features, a constant and the log degree), GIN/GINE layers, mean+max
    graph readout, a classifier over ``n_classes``."""

    def __init__(
        self,
        hidden: int,
        layers: int,
        dropout: float,
        in_dim: int = 0,
        edge_dim: int = 0,
        n_classes: int = N_CLASSES,
    ) -> None:
        super().__init__()
        self.in_dim, self.edge_dim = in_dim, edge_dim
        self.inp = nn.Linear(2 + in_dim, hidden)
        self.layers = nn.ModuleList(GINLayer(hidden, dropout, edge_dim) for _ in range(layers))
        self.head = nn.Sequential(
            nn.Linear(2 * hidden, hidden), nn.GELU(), nn.Linear(hidden, n_classes)
        )

    def logits(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        edge_index, batch = data["edge_index"], data["batch"]
        n = batch.shape[0]
        n_graphs = int(batch.max()) + 1
        deg = torch.zeros(n, device=batch.device).index_add_(
            0, edge_index[1], torch.ones(edge_index.shape[1], device=batch.device)
        )
        # A constant and the log degree (what any GNN computes in one layer), then the
        # node features when the data has them.
        feats = [torch.ones_like(deg)[:, None], torch.log1p(deg)[:, None]]
        if self.in_dim:
            feats.append(data["x"].to(deg.dtype))
        h = self.inp(torch.cat(feats, 1))
        edge_attr = data.get("edge_attr") if self.edge_dim else None
        for layer in self.layers:
            h = layer(h, edge_index, edge_attr)
        count = torch.zeros(n_graphs, device=h.device).index_add_(0, batch, torch.ones_like(deg))
        mean = torch.zeros(n_graphs, h.shape[1], device=h.device).index_add_(0, batch, h)
        mean = mean / count[:, None]
        mx = torch.full_like(mean, float("-inf")).scatter_reduce(
            0, batch[:, None].expand_as(h), h, "amax"
        )
        return self.head(torch.cat([mean, mx], 1))

    def forward(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = self.logits(data).float()
        return {
            "loss": F.cross_entropy(logits, data["y"]),
            "acc": (logits.argmax(1) == data["y"]).float().mean(),
        }


# ---- build -------------------------------------------------------------------------------
def datasets(config: TrainConfig) -> tuple[Dataset, Dataset]:
    """(train, eval): the user's graphs (recipe.data / pyg_dataset), else generated ones."""
    r = config.recipe
    if r["data"] or r["pyg_dataset"]:
        return user_datasets(config)
    if not 3 <= r["min_nodes"] <= r["max_nodes"]:
        raise ConfigError(
            f"recipe.min_nodes/max_nodes: {r['min_nodes']}..{r['max_nodes']}; "
            "expected 3 <= min_nodes <= max_nodes"
        )
    if not 2 <= r["mean_degree"] < r["min_nodes"]:
        raise ConfigError(
            f"recipe.mean_degree: {r['mean_degree']!r}; expected 2 <= degree "
            f"< min_nodes ({r['min_nodes']})"
        )
    args = (r["min_nodes"], r["max_nodes"], r["mean_degree"])
    seed = int(r["data_seed"])
    return GraphDataset(r["n_train"], *args, seed), GraphDataset(r["n_eval"], *args, seed + 1)


def _read(config: TrainConfig, path: str) -> list[Graph]:
    spec = config.recipe["pyg_dataset"]
    if spec and path == config.recipe["data"]:
        return graphs.rank0_first(lambda: graphs.load_pyg_dataset(spec, path))
    return graphs.load_file(path)


def user_datasets(config: TrainConfig) -> tuple[GraphList, GraphList]:
    """The user's graphs, checked, split (or with --eval-data), with equal widths."""
    r = config.recipe
    if not r["data"]:
        raise ConfigError("recipe.pyg_dataset needs recipe.data (--data): the dataset's root")
    train = _read(config, r["data"])
    if r["eval_data"]:
        evals = _read(config, r["eval_data"])
        if graphs.dims(evals) != graphs.dims(train):
            raise ConfigError(
                f"recipe.eval_data: feature widths (x, edge_attr) "
                f"{graphs.dims(evals)}; expected {graphs.dims(train)} as in "
                "recipe.data"
            )
    else:
        train, evals = graphs.split(train, float(r["eval_fraction"]), int(r["data_seed"]))
    return GraphList(train), GraphList(evals)


def n_classes(*data: Dataset) -> int:
    """Classes 0..the largest label of any graph (at least 2)."""
    return max(2, max(int(d.labels.max()) for d in data) + 1)  # type: ignore[attr-defined]


def make_model(
    config: TrainConfig, in_dim: int = 0, edge_dim: int = 0, classes: int = N_CLASSES
) -> GNN:
    m = config.model
    if m["hidden"] < 1 or m["layers"] < 1:
        raise ConfigError(f"model.hidden/layers: {m['hidden']}/{m['layers']}; expected >= 1")
    return seeded_model(
        config.training.seed,
        lambda: GNN(m["hidden"], m["layers"], m["dropout"], in_dim, edge_dim, classes),
    )


def model_for(config: TrainConfig, train: Dataset, evals: Dataset) -> GNN:
    """The model that fits these graphs: their feature widths and classes."""
    if isinstance(train, GraphList):
        in_dim, edge_dim = graphs.dims(train.graphs)
        return make_model(config, in_dim, edge_dim, n_classes(train, evals))
    return make_model(config)


@torch.no_grad()
def accuracy(model: GNN, data: GraphDataset) -> float:
    """Single-process accuracy over a whole dataset (tests, notebooks)."""
    batch = collate([data[i] for i in range(len(data))])
    model.eval()
    return float((model.logits(batch).argmax(1) == batch["y"]).float().mean())


def eval_fn(model: nn.Module, data: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per-graph means plus ``n`` = graphs in the batch: the Trainer sums mean * n and n."""
    out = model(data)
    return {"loss": out["loss"], "acc": out["acc"], "n": data["y"].shape[0]}


def build(config: TrainConfig) -> Built:
    train, evals = datasets(config)
    model = model_for(config, train, evals)
    if isinstance(train, GraphList):
        f, d = graphs.dims(train.graphs)
        log.info(
            "graphs: %d train, %d eval, node features %d, edge features %d, %d classes",
            len(train),
            len(cast(Sized, evals)),  # a torch Dataset declares no __len__; ours have one
            f,
            d,
            model.head[-1].out_features,
        )
    return Built(model, train, evals, None, eval_fn, collate)
