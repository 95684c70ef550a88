"""``--datafile processed_uniref50.pt``: seed 004's torch.save file, converted once into a
token store beside it (``ddp.data.processed``); any other shape, crafted or hostile file
is one line and leaves no store."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp.data import processed
from ddp.data.fasta import AMINO_ACIDS, N_SPECIALS, TOKENIZER, VOCAB_SIZE, resolve_store
from ddp.data.store import HEADER, TokenStore
from ddp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
# The seed's vocabulary, written out here independently of ddp.data.processed.
SEED = {
    "<s>": 0,
    "<pad>": 1,
    "</s>": 2,
    "<unk>": 3,
    "<mask>": 4,
    **{a: 5 + i for i, a in enumerate("ACDEFGHIKLMNPQRSTVWY")},
}


def _proteins(n: int = 24, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(rng.randint(5, 40)))
        for _ in range(n)
    ]


def _seed_tokens(seq: str, max_len: int = 48, bos_eos: bool = False) -> torch.Tensor:
    """As the seed's data script does: ids of its vocabulary, padded with <pad>."""
    ids = [SEED[c] for c in seq]
    if bos_eos:
        ids = [SEED["<s>"], *ids, SEED["</s>"]]
    return torch.tensor(ids + [SEED["<pad>"]] * (max_len - len(ids)), dtype=torch.long)


def _decode(ids) -> str:
    return "".join(AMINO_ACIDS[int(i) - N_SPECIALS] if i >= N_SPECIALS else "?" for i in ids)


def _store_of(path: Path) -> TokenStore:
    out = resolve_store(path)
    assert out == path.with_name(path.name + ".tokens")
    return TokenStore(out, TOKENIZER, VOCAB_SIZE)


def test_seed_records_become_the_same_proteins(tmp_path: Path) -> None:
    seqs = _proteins()
    # seed 004's layout: records {'protein_seq', 'prot_tokens', 'length'}
    recs = [
        {"protein_seq": s, "prot_tokens": _seed_tokens(s, bos_eos=i % 2 == 0), "length": len(s)}
        for i, s in enumerate(seqs)
    ]
    path = tmp_path / "processed_uniref50.pt"
    torch.save(recs, path)
    store = _store_of(path)
    assert store.n_seqs == len(seqs)
    assert [_decode(store[i]) for i in range(len(seqs))] == seqs  # residue for residue


@pytest.mark.parametrize("shape", ["list", "dict", "tuple", "rows", "int32"])
def test_the_accepted_shapes(tmp_path: Path, shape: str) -> None:
    seqs = _proteins(10, seed=1)
    tensors = [_seed_tokens(s) for s in seqs]
    obj = {
        "list": tensors,
        "dict": {"sequences": tensors, "n": 10, "name": "x"},
        "tuple": tuple(tensors),
        "rows": {"data": torch.stack(tensors)},
        "int32": [t.to(torch.int32) for t in tensors],
    }[shape]
    path = tmp_path / "data.pt"
    torch.save(obj, path)
    store = _store_of(path)
    assert [_decode(store[i]) for i in range(store.n_seqs)] == seqs


def test_unk_is_kept_and_empty_records_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "p.pt"
    torch.save(
        [torch.tensor([5, 3, 6, 1, 1]), torch.tensor([1, 1, 1]), torch.tensor([0, 7, 2])], path
    )
    store = _store_of(path)
    assert store.n_seqs == 2
    assert store[0].tolist() == [5, 4, 6] and store[1].tolist() == [7]  # <unk> is ours (4)


def test_converted_once_and_again_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "p.pt"
    torch.save([_seed_tokens("ACD")], path)
    header = resolve_store(path) / HEADER
    first = header.stat().st_mtime_ns
    resolve_store(path)
    assert header.stat().st_mtime_ns == first  # nothing converted the second time
    torch.save([_seed_tokens("WY"), _seed_tokens("KK")], path)
    os.utime(path, ns=(first + 10**9, first + 10**9))
    assert TokenStore(resolve_store(path), TOKENIZER, VOCAB_SIZE).n_seqs == 2


class _Thing:
    pass


def _hostile(tmp_path: Path) -> list[tuple[str, Path, str]]:
    cases: list[tuple[str, object, str]] = [
        ("nan", [torch.tensor([float("nan"), 5.0])], "1-D torch.float32 tensor"),
        ("negative", [torch.tensor([5, -3, 6])], "holds token id -3"),
        ("esm-ids", [torch.tensor([0, 30, 2])], "holds token id 30; expected ids 0-24"),
        ("mask", [torch.tensor([5, 4, 6])], "holds <mask>"),
        ("strings", ["MKV", "AAA"], "record 0 is str"),
        ("int", 7, "holds int"),
        ("two-lists", {"a": [torch.tensor([5])], "b": [torch.tensor([6])]}, "2 lists"),
        ("3-d", [torch.zeros(2, 2, 2, dtype=torch.long)], "3-D torch.int64"),
        ("bool", [torch.tensor([True, False])], "torch.bool"),
        ("empty", [torch.tensor([1, 1]), torch.tensor([0, 2])], "no residues"),
        (
            "record-two-tensors",
            [{"a": torch.tensor([5]), "b": torch.tensor([6])}],
            "a dict with 2 tensors",
        ),
        ("object", [_Thing()], "cannot be loaded with torch.load(weights_only=True)"),
    ]
    out = []
    for name, obj, match in cases:
        path = tmp_path / f"{name}.pt"
        torch.save(obj, path)
        out.append((name, path, match))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x80\x04not a pickle at all" * 10)
    out.append(("garbage", garbage, "cannot be loaded"))
    good = tmp_path / "good.pt"
    torch.save([torch.arange(5, 25)] * 50, good)
    cut = tmp_path / "truncated.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    out.append(("truncated", cut, "cannot be loaded"))
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    out.append(("fifo", fifo, "is a named pipe"))
    return out


def test_hostile_files_are_one_line_and_leave_no_store(tmp_path: Path) -> None:
    for name, path, match in _hostile(tmp_path):
        with pytest.raises(ConfigError) as err:
            resolve_store(path)
        text = str(err.value)
        assert match in text and "\n" not in text and len(text) < 600, (name, text)
        assert not path.with_name(path.name + ".tokens").exists(), name
    assert not [p for p in tmp_path.iterdir() if ".tokens" in p.name]  # no temporaries


def test_a_huge_file_is_refused_before_loading(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "huge.pt"
    torch.save([_seed_tokens("ACD")] * 100, path)
    monkeypatch.setattr(processed, "MAX_BYTES", 1024)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("loaded a huge file"))
    with pytest.raises(
        ConfigError, match=r"bytes, more than 1,024 \(.* GiB\); allowed: a smaller file"
    ):
        resolve_store(path)


def test_the_recipe_flag_refuses_a_bad_file_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "processed_uniref50.pt"
    torch.save({"sequences": [torch.tensor([1.5, float("nan")])]}, path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp",
            "uniref50",
            "--datafile",
            str(path),
            "--work_dir",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "record 0 is a 1-D torch.float32" in ln]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
