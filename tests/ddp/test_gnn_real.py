"""Seed 002 (gnn) for real: the user's own graphs with node and edge features, from a
PyTorch Geometric dataset and from the library-free .pt format, on 2 real Gloo ranks;
exact evaluation (1 rank == 2 ranks); W&B as the seed uses it (run name, epoch, finish).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from ddp.errors import ConfigError
from ddp.recipes import gnn, graphs, resolve
from tests.ddp import _launch
from tests.support.parts import require_module

PLAIN = ["--set", "logging.progress=plain"]


def _run(out: Path, *args: str, world: int = 2, ok: bool = True) -> list[tuple[int, str, str]]:
    argv = [
        "-m",
        "ddp",
        "gnn",
        "--config",
        "configs/gnn.yaml",
        *PLAIN,
        "--set",
        f"checkpoint.dir={out}",
        *args,
    ]
    results = _launch.run(argv, world=world, timeout=240)
    if ok:
        for rank, (rc, o, e) in enumerate(results):
            assert rc == 0, f"rank {rank} exit {rc}\n{o[-2000:]}\n{e[-3000:]}"
    return results


def _records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def make_graphs(n: int, seed: int) -> list[dict]:
    """Graphs whose class needs both feature kinds: bit 0 is the sign of the nodes'
    feature 0, bit 1 the sign of the edges' feature 0 (chance: 1/4; one kind: 1/2)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        nodes = int(torch.randint(6, 12, (1,), generator=g))
        edge_index = torch.randint(0, nodes, (2, 3 * nodes), generator=g)
        x = torch.randn(nodes, 3, generator=g)
        edge_attr = torch.randn(edge_index.shape[1], 2, generator=g)
        a, b = (int(v) for v in torch.randint(0, 2, (2,), generator=g))
        x[:, 0] += 2.0 if a else -2.0
        edge_attr[:, 0] += 2.0 if b else -2.0
        out.append({"edge_index": edge_index, "x": x, "edge_attr": edge_attr, "y": a + 2 * b})
    return out


def _exact_eval(model: torch.nn.Module, evals) -> dict[str, float]:
    """Single-process loss and accuracy over every held-out graph at once."""
    batch = graphs.collate([evals[i] for i in range(len(evals))])
    model.eval()
    with torch.no_grad():
        logits = model.logits(batch).double()
    return {
        "eval_loss": float(F.cross_entropy(logits, batch["y"])),
        "eval_acc": float((logits.argmax(1) == batch["y"]).double().mean()),
    }


def _loaded(out: Path, sets: list[str]):
    cfg = resolve(gnn, _launch.ROOT / "configs/gnn.yaml", sets)
    train, evals = gnn.datasets(cfg)
    model = gnn.model_for(cfg, train, evals)
    model.load_state_dict(torch.load(out / "final" / "model.pt", weights_only=True))
    return model, evals


def _writes(log: str) -> list[int]:
    return [
        int(x.split(" at step ")[1].split()[0])
        for x in log.splitlines()
        if x.startswith("best model:")
    ]


def _improving_steps(evals: list[dict]) -> list[int]:
    best, steps = float("inf"), []
    for r in evals:
        if r["eval_loss"] < best:
            best = r["eval_loss"]
            steps.append(r["step"])
    return steps


# ---- the library-free format --------------------------------------------------------------
def test_library_free_graphs_train_on_two_ranks_with_node_and_edge_features(
    tmp_path: Path,
) -> None:
    data = tmp_path / "graphs.pt"
    torch.save(make_graphs(128, 0), data)
    out = tmp_path / "ck"
    results = _run(out, "--data", str(data), "--epochs", "3", "--hidden", "16", "--batch-size", "8")
    log = results[0][1] + results[0][2]
    assert "graphs: 103 train, 25 eval, node features 3, edge features 2, 4 classes" in log
    sets = [f"recipe.data={data}", "model.hidden=16"]
    model, evals = _loaded(out, sets)
    assert (model.in_dim, model.edge_dim) == (3, 2)  # both feature kinds reach the model
    want = _exact_eval(model, evals)
    assert want["eval_acc"] >= 0.9, want  # needs x and edge_attr: one kind gives <= 0.5
    recs = _records(out, "eval")
    # the 2-rank evaluation (unpadded shards, sums all-reduced) is the exact value
    assert recs[-1]["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-6)
    assert recs[-1]["eval_acc"] == pytest.approx(want["eval_acc"], abs=1e-6)
    # best/model.pt: written on each improvement of eval/loss, and only then
    assert _writes(log) == _improving_steps(recs) and _writes(log)
    assert "best model:" not in results[1][1] + results[1][2]
    assert (out / "best_model.pt").resolve() == (out / "best" / "model.pt").resolve()


def test_edge_and_node_features_change_the_output() -> None:
    """The features are read by the forward pass, not only carried in the batch."""
    cfg = resolve(gnn, None, ["model.hidden=16"])
    model = gnn.make_model(cfg, in_dim=3, edge_dim=2, classes=4)
    items = graphs.check_graphs(make_graphs(4, 1), "test")
    batch = graphs.collate(items)
    base = model.logits(batch)
    for key in ("x", "edge_attr"):
        changed = dict(batch, **{key: batch[key] + 1.0})
        assert not torch.allclose(model.logits(changed), base), key


# ---- PyTorch Geometric ----------------------------------------------------------------------
def _pyg_file(path: Path, n: int, seed: int) -> None:
    pyg_data = require_module("torch_geometric.data", reason="torch_geometric: test extra")
    items = [
        pyg_data.Data(
            x=g["x"], edge_index=g["edge_index"], edge_attr=g["edge_attr"], y=torch.tensor([g["y"]])
        )
        for g in make_graphs(n, seed)
    ]
    pyg_data.InMemoryDataset.save(items, str(path))


def test_evaluation_is_exact_on_one_and_two_ranks(tmp_path: Path) -> None:
    """The same weights (epochs 0: the seeded initial model) evaluated by 1 and 2 ranks
    over 31 held-out graphs (uneven shards, short last batches) from a PyG file."""
    data, evals_file = tmp_path / "train.pt", tmp_path / "eval.pt"
    _pyg_file(data, 16, 2)
    _pyg_file(evals_file, 31, 3)
    args = [
        "--data",
        str(data),
        "--eval-data",
        str(evals_file),
        "--epochs",
        "0",
        "--hidden",
        "16",
        "--batch-size",
        "4",
    ]
    got = {}
    for world in (1, 2):
        out = tmp_path / f"ck{world}"
        _run(out, *args, world=world)
        (rec,) = _records(out, "eval")
        got[world] = rec
    model, evals = _loaded(
        tmp_path / "ck1",
        [f"recipe.data={data}", f"recipe.eval_data={evals_file}", "model.hidden=16"],
    )
    assert len(evals) == 31
    want = _exact_eval(model, evals)
    for world in (1, 2):
        assert got[world]["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-6)
        # float32 per-batch means: 1e-6 is far below one graph's share (1/31)
        assert got[world]["eval_acc"] == pytest.approx(want["eval_acc"], abs=1e-6)
    assert got[1]["eval_loss"] == pytest.approx(got[2]["eval_loss"], rel=1e-6)
    assert got[1]["eval_acc"] == pytest.approx(got[2]["eval_acc"], abs=1e-6)


def _tu_dataset(root: Path, name: str, items: list[dict]) -> None:
    """A TUDataset in its raw text format (github.com/chrsmrrs/datasets' layout), as a
    user who has the files would have it: ROOT/NAME/raw/NAME_*.txt."""
    raw = root / name / "raw"
    raw.mkdir(parents=True)
    a, ind, labels, nattr, eattr, offset = [], [], [], [], [], 0
    for gi, g in enumerate(items):
        for s_, d_ in g["edge_index"].T.tolist():
            if s_ != d_:  # TUDataset drops self-loops; keep edge_attr aligned
                a.append(f"{s_ + offset + 1}, {d_ + offset + 1}")
        for (s_, d_), row in zip(g["edge_index"].T.tolist(), g["edge_attr"].tolist(), strict=True):
            if s_ != d_:
                eattr.append(", ".join(f"{v:.6f}" for v in row))
        ind += [str(gi + 1)] * g["x"].shape[0]
        nattr += [", ".join(f"{v:.6f}" for v in row) for row in g["x"].tolist()]
        labels.append(str(g["y"]))
        offset += g["x"].shape[0]
    for suffix, lines in (
        ("A", a),
        ("graph_indicator", ind),
        ("graph_labels", labels),
        ("node_attributes", nattr),
        ("edge_attributes", eattr),
    ):
        (raw / f"{name}_{suffix}.txt").write_text("\n".join(lines) + "\n")


def test_pyg_tudataset_on_two_ranks(tmp_path: Path) -> None:
    """torch_geometric's real TUDataset class processes the test's raw files (rank 0
    first, the other rank reads what it processed), then 2 ranks train on it."""
    require_module("torch_geometric", reason="torch_geometric is in the test extra")
    root = tmp_path / "tu"
    _tu_dataset(root, "TOY", make_graphs(96, 4))
    out = tmp_path / "ck"
    results = _run(
        out,
        "--pyg-dataset",
        "TUDataset:TOY",
        "--data",
        str(root),
        "--epochs",
        "3",
        "--hidden",
        "16",
        "--batch-size",
        "8",
    )
    log = results[0][1] + results[0][2]
    assert "graphs: 77 train, 19 eval, node features 3, edge features 2, 4 classes" in log
    assert (root / "TOY" / "processed").is_dir()
    model, evals = _loaded(
        out, ["recipe.pyg_dataset=TUDataset:TOY", f"recipe.data={root}", "model.hidden=16"]
    )
    want = _exact_eval(model, evals)
    assert want["eval_acc"] >= 0.75, want
    assert _records(out, "eval")[-1]["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-6)


# ---- crafted graph files: one line each ----------------------------------------------------
def _g(**change: object) -> dict:
    g = {
        "edge_index": torch.tensor([[0, 1], [1, 2]]),
        "x": torch.ones(3, 2),
        "edge_attr": torch.ones(2, 1),
        "y": 1,
    }
    g.update(change)
    return {k: v for k, v in g.items() if v is not None}


CRAFTED = [
    (
        [_g(), _g(edge_index=torch.tensor([[0, 3], [1, 2]]))],
        "graph 1: edge_index: node index 0..3; expected indices in [0, 3)",
    ),
    ([_g(edge_index=torch.tensor([[0, -1], [1, 2]]))], "graph 0: edge_index: node index -1..2"),
    (
        [_g(edge_index=torch.tensor([[0.0, 1.0], [1.0, 2.0]]))],
        "graph 0: edge_index: dtype torch.float32; expected an integer tensor (2, E)",
    ),
    ([_g(edge_index=torch.zeros(3, 2, dtype=torch.long))], "graph 0: edge_index: shape (3, 2)"),
    (
        [_g(x=torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [1.0, 1.0]]))],
        "graph 0: x: holds nan or inf",
    ),
    ([_g(x=torch.ones(3, 2, 2))], "graph 0: x: shape (3, 2, 2)"),
    ([_g(x=torch.ones(0, 2))], "graph 0: x: shape (0, 2); expected (N >= 1 nodes, F)"),
    ([_g(edge_attr=torch.ones(5, 1))], "graph 0: edge_attr: shape (5, 1); expected (2, width"),
    ([_g(edge_attr=torch.tensor([[float("inf")], [0.0]]))], "graph 0: edge_attr: holds nan"),
    ([_g(y=1.5)], "graph 0: y: 1.5; expected an integer class label"),
    ([_g(y=10**12)], "graph 0: y: 1000000000000"),
    ([_g(y=-1)], "graph 0: y: -1"),
    ([_g(y=torch.tensor([0.0]))], "graph 0: y: a torch.float32 tensor"),
    ([_g(y=None)], "graph 0: y: missing"),
    ([_g(x=None)], "graph 0: x: missing"),
    ([_g(pos=torch.ones(3, 2))], "graph 0: pos: unknown key; expected only edge_index, x"),
    ([_g(), _g(x=torch.ones(3, 5))], "graph 1: x: width 5; expected width 2, as in graph 0"),
    ([_g(), _g(edge_attr=None)], "graph 1: edge_attr: width absent; expected width 1"),
    ([_g(), "not a graph"], "graph 1: graph: a str; expected a dict"),
    ([], "no graphs; expected a non-empty list"),
    ({"graphs": []}, "holds a dict; expected a list of graphs"),
]


@pytest.mark.parametrize(("obj", "line"), CRAFTED, ids=[c[1][:40] for c in CRAFTED])
def test_crafted_graph_files_are_one_line(tmp_path: Path, obj: object, line: str) -> None:
    path = tmp_path / "g.pt"
    torch.save(obj, path)
    with pytest.raises(ConfigError) as err:
        graphs.load_file(path)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert msg.startswith((f"{path}: ", f"recipe.data: {path} ")), msg
    assert line in msg, msg


class Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("kind", ["pickle", "pyg-list", "garbage", "fifo", "dir", "missing"])
def test_unreadable_graph_files_are_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "g.pt"
    if kind == "pickle":
        torch.save([Evil()], path)
    elif kind == "pyg-list":  # torch.save of Data objects: not weights_only; PyG's own save is
        pyg_data = require_module("torch_geometric.data", reason="test extra")
        torch.save(
            [
                pyg_data.Data(
                    x=torch.ones(2, 1), edge_index=torch.zeros(2, 0).long(), y=torch.tensor([0])
                )
            ],
            path,
        )
    elif kind == "garbage":
        path.write_bytes(b"\x00\x01 not a torch file")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    with pytest.raises(ConfigError) as err:
        graphs.load_file(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"recipe.data: {path}"), msg
    if kind in ("pickle", "pyg-list"):
        assert "pickled Python object" in msg and "InMemoryDataset.save" in msg, msg
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def test_a_bad_graph_file_through_the_cli_is_one_line_on_every_rank(tmp_path: Path) -> None:
    data = tmp_path / "g.pt"
    torch.save([_g()] * 4 + [_g(edge_index=torch.tensor([[0, 7], [1, 2]]))], data)
    results = _run(tmp_path / "ck", "--data", str(data), world=2, ok=False)
    for rc, _, err in results:
        assert rc == 2
        assert (
            err.strip()
            .splitlines()[-1]
            .endswith(
                f"{data}: graph 4: edge_index: node index 0..7; expected indices in [0, 3) "
                "(the graph has 3 nodes)"
            )
        )
    assert not (tmp_path / "ck" / "final").exists()


# ---- W&B as seed 002 uses it ----------------------------------------------------------------
SMALL = ["--set", "recipe.n_train=48", "--set", "recipe.n_eval=24", "--hidden", "16"]


def _wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline W&B into tmp_path (the ranks inherit the test's environment)."""
    require_module("wandb", reason="wandb is in the test extra")
    for k, v in {
        "WANDB_DIR": str(tmp_path),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }.items():
        monkeypatch.setenv(k, v)


def _wandb_file(tmp_path: Path) -> bytes:
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 only
    (history,) = runs[0].glob("run-*.wandb")
    return history.read_bytes()


def test_wandb_offline_run_has_the_run_name_and_epoch(tmp_path: Path, monkeypatch) -> None:
    _wandb_env(tmp_path, monkeypatch)
    out = tmp_path / "ck"
    _run(
        out, "--epochs", "2", *SMALL, "--wandb-project", "cricket-gnn", "--run-name", "seed-002-run"
    )
    data = _wandb_file(tmp_path)
    # wandb 0.31 writes protobuf records (read in Go only): the run record's display_name
    # (field 8) is the run name, and each history item is its key then its value as JSON.
    assert b"B\x0cseed-002-run" in data
    epochs = {int(v) for v in re.findall(rb"\x12\x05epoch\x82\x01.(\d+)", data)}
    logged = {r["epoch"] for r in _records(out, "train")}
    assert epochs == logged == {0, 1}
    # wandb.finish() ran: the exit record (field 18) is there, exit code 0 (omitted)
    assert re.search(rb"\x92\x01\x02\x10", data), data[-200:]


def test_wandb_finishes_failed_when_rank_0_dies(tmp_path: Path, monkeypatch) -> None:
    """A diverged run ends every rank through ddp.parts.die (os._exit, no `finally`):
    rank 0 still calls wandb.finish(exit_code=1) first."""
    _wandb_env(tmp_path, monkeypatch)
    results = _run(
        tmp_path / "ck",
        "--epochs",
        "2",
        *SMALL,
        "--lr",
        "1e37",
        "--set",
        "optim.grad_clip=null",
        "--wandb-project",
        "cricket-gnn",
        ok=False,
    )
    assert results[0][0] == 2 and "training diverged" in results[0][2]
    data = _wandb_file(tmp_path)
    assert re.search(rb"\x92\x01.\x08\x01", data), data[-200:]  # exit record, exit_code 1


def test_pyg_sources_without_torch_geometric_are_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "pyg.pt"
    _pyg_file(path, 3, 0)
    for name in (
        "torch_geometric",
        "torch_geometric.data",
        "torch_geometric.datasets",
        "torch_geometric.data.data",
    ):
        monkeypatch.setitem(__import__("sys").modules, name, None)  # import fails
    with pytest.raises(ConfigError, match=r"needs pip install hpc-ddp\[gnn\]"):
        graphs.load_pyg_dataset("TUDataset:MUTAG", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        graphs.load_file(path)
    # (torch resolves the Data class it already knows in this process: the file loads,
    # and slicing it into graphs is what needs torch_geometric)
    assert str(err.value) == (
        f"recipe.data: {path} is a torch_geometric dataset file; "
        "reading it needs pip install hpc-ddp[gnn] (torch_geometric)"
    )


def test_wandb_init_gets_the_name_and_init_timeout(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    wandb = require_module("wandb", reason="wandb is in the test extra")
    from ddp import loggers

    seen: list[dict] = []

    def init(**kwargs: object) -> str:
        seen.append(kwargs)
        return "run"

    monkeypatch.setattr(wandb, "init", init)
    cfg = resolve(gnn, None, ["logging.wandb.project=cricket-gnn", "recipe.run_name=r1"])
    assert loggers.open_wandb(cfg) == "run"
    assert seen[-1]["name"] == "r1" and seen[-1]["settings"].init_timeout == 120
    cfg = resolve(
        gnn,
        None,
        [
            "logging.wandb.project=p",
            "recipe.run_name=r1",
            "logging.wandb.name=explicit",
            "logging.wandb.init_timeout=300",
        ],
    )
    loggers.open_wandb(cfg)
    assert seen[-1]["name"] == "explicit" and seen[-1]["settings"].init_timeout == 300

    def timeout(**kwargs: object) -> None:
        raise wandb.errors.CommError("Run initialization has timed out after 300.0 sec.")

    monkeypatch.setattr(wandb, "init", timeout)
    with caplog.at_level("WARNING", logger="ddp"):
        assert loggers.open_wandb(cfg) is None  # the run goes on without W&B
    assert "wandb.init failed (Run initialization has timed out" in caplog.text


def test_seed_defaults_drop_last_and_best_model() -> None:
    """Seed 002's DistributedSampler(drop_last=True) and best_model.pt, in the recipe's
    defaults and in configs/gnn.yaml alike."""
    for cfg in (resolve(gnn), resolve(gnn, _launch.ROOT / "configs/gnn.yaml")):
        assert cfg.training.drop_last is True
    best = resolve(gnn, _launch.ROOT / "configs/gnn.yaml").checkpoint.best
    assert (best.metric, best.mode) == ("eval/loss", "min")
