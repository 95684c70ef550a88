"""The user's graphs for the gnn recipe (seed 002): read, checked, batched by graph.

Three sources, one result: a list of :class:`Graph` (node features ``x``, ``edge_index``,
optional ``edge_attr``, graph label ``y``), so the model and the Trainer see the same
thing whichever the user brings.

1. **Library-free** (``--data graphs.pt``, no torch_geometric needed): a ``.pt`` file
   holding a list of dicts, written with plain ``torch.save``::

       [{"edge_index": LongTensor (2, E), "x": FloatTensor (N, F),
         "edge_attr": FloatTensor (E, D),  # optional, in every graph or in none
         "y": int or a one-element integer tensor}, ...]

   ``edge_index`` holds node indices in ``[0, N)`` (both directions for an undirected
   edge: a message flows from ``edge_index[0]`` to ``edge_index[1]``). Loaded with
   ``torch.load(weights_only=True)`` from a regular file of bounded size; every field
   of every graph is checked (type, dtype, shape, index range, finite values, the same
   F and D in all graphs) and a bad one is one line naming the graph and the field.
2. **A PyTorch Geometric file** (``--data data.pt``, torch_geometric installed): what
   ``InMemoryDataset.save(data_list, path)`` writes (PyG's own format for a list of
   ``Data``). Read with ``weights_only=True`` here (PyG's loader falls back to an
   unrestricted unpickle), sliced into ``Data`` objects by PyG, then checked as in 1.
3. **A PyTorch Geometric dataset class** (``--pyg-dataset TUDataset:MUTAG --data
   ROOT``): any class of ``torch_geometric.datasets`` by name, built on ``ROOT`` as
   PyG builds it (raw files there are processed; missing ones are downloaded by PyG,
   so on a compute node without network put them there first). Rank 0 builds it first,
   the other ranks then read what it processed. The class reads its own processed file
   with PyG's loader, so point ROOT at data you trust. TUDataset keeps its continuous
   node and edge attributes (``use_node_attr``/``use_edge_attr``).

A PyG ``Data`` without ``x`` gets one constant feature per node (the model adds the
log degree itself), as the generated quick-start graphs do.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils.data import Dataset

from ddp.errors import ConfigError
from hpc_ddp import files as _files

MAX_FILE_BYTES = 16 << 30
"""A graph file is read whole into memory: refuse one larger than this (16 GiB)."""
MAX_CLASSES = 100_000
"""Graph labels index the classifier's output: a crafted label of 10**12 must not size it."""
FIELDS = ("edge_index", "x", "edge_attr", "y")
PYG_EXTRA = "pip install hpc-ddp[gnn] (torch_geometric)"


@dataclass
class Graph:
    """One checked graph; ``x`` None: no node features (constant input)."""

    edge_index: torch.Tensor  # long (2, E)
    n_nodes: int
    y: int
    x: torch.Tensor | None = None  # float32 (N, F)
    edge_attr: torch.Tensor | None = None  # float32 (E, D)


class GraphList(Dataset):
    """Checked graphs as a Dataset; ``labels`` for baselines, ``dims`` = (F, D)."""

    def __init__(self, graphs: list[Graph]) -> None:
        self.graphs = graphs
        self.labels = torch.tensor([g.y for g in graphs], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.graphs)

    def __getitem__(self, i: int) -> Graph:
        return self.graphs[i]


def dims(graphs: Sequence[Graph]) -> tuple[int, int]:
    """(node feature width F, edge feature width D); 0 = none."""
    g = graphs[0]
    return (0 if g.x is None else g.x.shape[1], 0 if g.edge_attr is None else g.edge_attr.shape[1])


def collate(items: list[Graph]) -> dict[str, torch.Tensor]:
    """Many graphs -> one block-diagonal graph with a node -> graph index (PyG's
    ``Batch`` layout). ``y`` first: the Trainer counts samples by the first value."""
    edges, batch, xs, eas, offset = [], [], [], [], 0
    for gi, g in enumerate(items):
        edges.append(g.edge_index + offset)
        batch.append(torch.full((g.n_nodes,), gi, dtype=torch.long))
        if g.x is not None:
            xs.append(g.x)
        if g.edge_attr is not None:
            eas.append(g.edge_attr)
        offset += g.n_nodes
    out = {
        "y": torch.tensor([g.y for g in items], dtype=torch.long),
        "edge_index": torch.cat(edges, 1),
        "batch": torch.cat(batch),
    }
    if xs:
        out["x"] = torch.cat(xs)
    if eas:
        out["edge_attr"] = torch.cat(eas)
    return out


# ---- checking ------------------------------------------------------------------------------
def _bad(where: str, i: int, field: str, problem: str, allowed: str) -> ConfigError:
    return ConfigError(f"{where}: graph {i}: {field}: {problem}; expected {allowed}")


def _features(v: Any, where: str, i: int, field: str, rows: int, rows_name: str) -> torch.Tensor:
    allowed = f"a float tensor ({rows_name}, width) of finite values"
    if not isinstance(v, torch.Tensor):
        raise _bad(where, i, field, f"a {type(v).__name__}", allowed)
    if v.dtype == torch.bool or v.is_complex():
        raise _bad(where, i, field, f"dtype {v.dtype}", allowed)
    if v.dim() == 1:  # one feature per row, as PyG allows
        v = v.unsqueeze(1)
    if v.dim() != 2 or v.shape[0] != rows or v.shape[1] < 1:
        raise _bad(where, i, field, f"shape {tuple(v.shape)}", f"({rows}, width >= 1)")
    v = v.to(torch.float32)
    if not bool(torch.isfinite(v).all()):
        raise _bad(where, i, field, "holds nan or inf", allowed)
    return v


def check_graph(item: Any, where: str, i: int) -> Graph:
    """One graph (a dict of FIELDS, or a PyG Data turned into one) checked and
    normalised; a ConfigError naming graph ``i`` and the field otherwise."""
    if not isinstance(item, dict):
        raise _bad(
            where,
            i,
            "graph",
            f"a {type(item).__name__}",
            "a dict with edge_index, x, optional edge_attr, y",
        )
    unknown = sorted(str(k) for k in item if k not in FIELDS)
    if unknown:
        raise _bad(where, i, unknown[0], "unknown key", f"only {', '.join(FIELDS)}")
    for key in ("edge_index", "x", "y"):
        if key not in item:
            raise _bad(where, i, key, "missing", "every graph to have edge_index, x and y")
    ei, x = item["edge_index"], item["x"]
    if not isinstance(ei, torch.Tensor) or ei.dtype not in (
        torch.int64,
        torch.int32,
        torch.int16,
        torch.uint8,
    ):
        what = f"dtype {ei.dtype}" if isinstance(ei, torch.Tensor) else f"a {type(ei).__name__}"
        raise _bad(where, i, "edge_index", what, "an integer tensor (2, E)")
    if ei.dim() != 2 or ei.shape[0] != 2:
        raise _bad(where, i, "edge_index", f"shape {tuple(ei.shape)}", "(2, E)")
    if not isinstance(x, torch.Tensor):
        raise _bad(where, i, "x", f"a {type(x).__name__}", "a float tensor (N, F)")
    if x.dim() == 0 or x.shape[0] < 1:
        raise _bad(where, i, "x", f"shape {tuple(x.shape)}", "(N >= 1 nodes, F)")
    n = int(x.shape[0])
    x = _features(x, where, i, "x", n, "N nodes")
    ei = ei.to(torch.long)
    if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= n):
        raise _bad(
            where,
            i,
            "edge_index",
            f"node index {int(ei.min())}..{int(ei.max())}",
            f"indices in [0, {n}) (the graph has {n} nodes)",
        )
    ea = item.get("edge_attr")
    if ea is not None:
        ea = _features(ea, where, i, "edge_attr", int(ei.shape[1]), "E edges")
    y = item["y"]
    if isinstance(y, torch.Tensor):
        if y.numel() != 1 or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise _bad(
                where,
                i,
                "y",
                f"a {y.dtype} tensor of shape {tuple(y.shape)}",
                "one integer class label",
            )
        y = int(y.reshape(()))
    if isinstance(y, bool) or not isinstance(y, int) or not 0 <= y < MAX_CLASSES:
        raise _bad(where, i, "y", repr(y), f"an integer class label in [0, {MAX_CLASSES})")
    return Graph(ei.contiguous(), n, y, x, ea)


def check_graphs(items: Sequence[Any], where: str) -> list[Graph]:
    """Every graph checked, then the same feature widths in all of them."""
    if not items:
        raise ConfigError(f"{where}: no graphs; expected a non-empty list of graphs")
    graphs = [check_graph(item, where, i) for i, item in enumerate(items)]
    first = dims(graphs[:1])
    for i, g in enumerate(graphs):
        for field, have, want in (
            ("x", dims([g])[0], first[0]),
            ("edge_attr", dims([g])[1], first[1]),
        ):
            if have != want:
                raise _bad(
                    where,
                    i,
                    field,
                    f"width {have or 'absent'}",
                    f"width {want or 'absent'}, as in graph 0",
                )
    return graphs


# ---- sources -------------------------------------------------------------------------------
def _pyg_data_to_dict(d: Any) -> dict[str, Any]:
    """A PyG ``Data`` as the library-free dict (only the fields the model reads)."""
    out: dict[str, Any] = {"edge_index": d.edge_index, "y": d.y}
    if getattr(d, "x", None) is not None:
        out["x"] = d.x
    else:
        out["num_nodes"] = d.num_nodes
    if getattr(d, "edge_attr", None) is not None:
        out["edge_attr"] = d.edge_attr
    return out


def check_graph_with_nodes(item: dict[str, Any], where: str, i: int) -> Graph:
    """:func:`check_graph` for a PyG graph, which may give ``num_nodes`` instead of x."""
    n = item.pop("num_nodes", None)
    if n is None:
        return check_graph(item, where, i)
    if not isinstance(n, int) or n < 1:
        raise _bad(where, i, "num_nodes", repr(n), "an integer >= 1")
    item = {**item, "x": torch.ones(n, 1)}
    return check_graph(item, where, i)


def from_pyg(data_list: Sequence[Any], where: str) -> list[Graph]:
    """PyG ``Data`` objects (a dataset or a list) -> checked graphs."""
    if len(data_list) == 0:
        raise ConfigError(f"{where}: no graphs; expected a non-empty dataset")
    graphs = [
        check_graph_with_nodes(_pyg_data_to_dict(d), where, i) for i, d in enumerate(data_list)
    ]
    return check_graphs([_as_dict(g) for g in graphs], where)


def _as_dict(g: Graph) -> dict[str, Any]:
    out: dict[str, Any] = {"edge_index": g.edge_index, "x": g.x, "y": g.y}
    if g.edge_attr is not None:
        out["edge_attr"] = g.edge_attr
    return out


def load_file(path: str | Path) -> list[Graph]:
    """A library-free list of dicts, or PyG's ``InMemoryDataset.save`` format."""
    where = str(path)
    try:
        raw, _ = _files.read_regular(path, MAX_FILE_BYTES + 1)
    except _files.NotRegular as exc:
        raise ConfigError(f"recipe.data: {where} {exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"recipe.data: {where} is larger than {MAX_FILE_BYTES >> 30} GiB")
    _register_pyg_globals()
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        if "Weights only load failed" in text:
            # torch's message is many lines (with terminal escapes); the fact is this:
            found = re.search(r"GLOBAL ([\w.]+)", text)
            if found and found.group(1).startswith("torch_geometric.") and not _has_pyg():
                raise ConfigError(
                    f"recipe.data: {where} holds torch_geometric objects; "
                    f"reading it needs {PYG_EXTRA}"
                ) from None
            first = (
                "it holds a pickled Python object"
                + (f" ({found.group(1)})" if found else "")
                + ", not only tensors"
            )
        else:
            first = (text.strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(
            f"recipe.data: {where} is not a graph file torch.load(weights_only=True) can "
            f"read ({first}); expected a list of dicts (edge_index, x, edge_attr, y) saved "
            "with torch.save, or torch_geometric's InMemoryDataset.save(data_list, path)"
        ) from None
    if isinstance(obj, tuple) and len(obj) in (2, 3) and isinstance(obj[0], dict):
        return _from_pyg_saved(obj, where)
    if not isinstance(obj, list | tuple):
        raise ConfigError(
            f"recipe.data: {where} holds a {type(obj).__name__}; expected a "
            "list of graphs (dicts of edge_index, x, edge_attr, y)"
        )
    return check_graphs(list(obj), where)


def _register_pyg_globals() -> None:
    """Importing torch_geometric allow-lists its Data classes for weights_only loads."""
    _has_pyg()


def _has_pyg() -> bool:
    try:
        import torch_geometric  # noqa: F401
    except ImportError:
        return False
    return True


def _from_pyg_saved(obj: tuple[Any, ...], where: str) -> list[Graph]:
    try:
        from torch_geometric.data import InMemoryDataset
        from torch_geometric.data.data import BaseData, Data
    except ImportError:
        raise ConfigError(
            f"recipe.data: {where} is a torch_geometric dataset file; reading it needs {PYG_EXTRA}"
        ) from None
    data, slices = obj[0], obj[1]
    cls = obj[2] if len(obj) == 3 else Data
    if not (isinstance(cls, type) and issubclass(cls, BaseData) and isinstance(slices, dict)):
        raise ConfigError(
            f"recipe.data: {where} is not InMemoryDataset.save's format "
            "(data dict, slices dict, Data class)"
        )
    ds = InMemoryDataset()
    try:
        # cls: a torch_geometric class (an untyped library, so only "a type" here)
        ds.data, ds.slices = cast(Any, cls).from_dict(data), slices
        items = [ds[i] for i in range(len(ds))]
    except Exception as exc:
        raise ConfigError(
            f"recipe.data: {where}: torch_geometric cannot slice it into "
            f"graphs ({type(exc).__name__}: {exc})"
        ) from None
    return from_pyg(items, where)


def load_pyg_dataset(spec: str, root: str) -> list[Graph]:
    """``CLASS[:NAME]`` of ``torch_geometric.datasets`` built on ``root`` (see module doc)."""
    try:
        import torch_geometric.datasets as pyg_datasets
        from torch_geometric.data import Dataset as PygDataset
    except ImportError:
        raise ConfigError(f"recipe.pyg_dataset: {spec!r} needs {PYG_EXTRA}") from None
    cls_name, _, name = spec.partition(":")
    cls = getattr(pyg_datasets, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, PygDataset)):
        raise ConfigError(
            f"recipe.pyg_dataset: {cls_name!r} is not a dataset class of "
            "torch_geometric.datasets; expected e.g. TUDataset:MUTAG"
        )
    if not root:
        raise ConfigError(
            f"recipe.pyg_dataset: {spec!r} needs recipe.data (--data): the dataset's root folder"
        )
    kwargs: dict[str, Any] = {"root": root}
    if name:
        kwargs["name"] = name
    if cls_name == "TUDataset":
        kwargs.update(use_node_attr=True, use_edge_attr=True)
    try:
        ds = cls(**kwargs)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ConfigError(
            f"recipe.pyg_dataset: {spec} on {root}: {type(exc).__name__}: {first}"
        ) from None
    return from_pyg([ds[i] for i in range(len(ds))], f"{spec} ({root})")


def rank0_first(load: Callable[[], list[Graph]]) -> list[Graph]:
    """``load()`` on rank 0, then on the others (a PyG dataset processes its raw files
    once, into files the others read); an error on rank 0 is every rank's line."""
    import ddp

    ctx = ddp.get_context()
    if ctx is None or ctx.world_size == 1:
        return load()
    graphs, error = None, None
    if ctx.is_main:
        try:
            graphs = load()
        except ConfigError as exc:
            error = str(exc)
    error = ddp.broadcast_object(error)  # also the barrier: rank 0 has finished
    if error:
        raise ConfigError(error)
    return graphs if graphs is not None else load()


def split(graphs: list[Graph], fraction: float, seed: int) -> tuple[list[Graph], list[Graph]]:
    """A seeded split into (train, eval): the same on every rank and every world size."""
    if not 0 < fraction < 1:
        raise ConfigError(
            f"recipe.eval_fraction: {fraction!r}; expected a fraction in "
            "(0, 1) of the graphs held out, or recipe.eval_data"
        )
    n_eval = max(1, math.floor(len(graphs) * fraction))
    if n_eval >= len(graphs):
        raise ConfigError(
            f"recipe.data: {len(graphs)} graphs cannot be split into train "
            f"and eval (eval_fraction {fraction}); expected at least 2"
        )
    order = torch.randperm(len(graphs), generator=torch.Generator().manual_seed(seed)).tolist()
    return [graphs[i] for i in order[n_eval:]], [graphs[i] for i in order[:n_eval]]
