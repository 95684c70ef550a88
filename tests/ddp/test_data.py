"""ddp.data: token stores, FASTA preparation, the recipe's data inputs (one line, exit 2)."""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp.data import fasta
from ddp.data.dataset import TokenDataset
from ddp.data.store import TokenStore
from ddp.data.store_write import StoreWriter, write_store
from ddp.errors import ConfigError
from ddp.recipes._common import encode
from ddp.recipes.uniref50 import read_fasta
from tests.ddp._launch import base_env

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "src" / "ddp" / "recipes" / "data" / "uniref50_tiny.fasta"


def _fasta(path: Path, seqs: dict[str, str], width: int = 7, crlf: bool = False) -> Path:
    nl = "\r\n" if crlf else "\n"
    text = "".join(
        f">{k} desc{nl}" + nl.join(s[i : i + width] for i in range(0, len(s), width)) + nl
        for k, s in seqs.items()
    )
    path.write_text(text)
    return path


def _seqs(n: int, seed: int = 0) -> dict[str, str]:
    rng = np.random.default_rng(seed)
    aa = np.array(list("ACDEFGHIKLMNPQRSTVWYXBZ*"))
    return {f"SEQ{i}": "".join(rng.choice(aa, rng.integers(1, 40))) for i in range(n)}


@pytest.mark.parametrize("chunk", [16, 50, 1 << 20])
@pytest.mark.parametrize("crlf", [False, True])
def test_prepare_matches_a_plain_python_reader(
    tmp_path: Path, monkeypatch, chunk: int, crlf: bool
) -> None:
    """Any chunk size (sequences and lines cut across chunks, lines longer than a chunk)."""
    monkeypatch.setattr(fasta, "CHUNK", chunk)
    seqs = _seqs(200)
    src = _fasta(tmp_path / "a.fasta", seqs, width=23, crlf=crlf)
    store = fasta.prepare_fasta(src, tmp_path / "st")
    assert store.n_seqs == 200
    for i, s in enumerate(seqs.values()):
        assert store[i].tolist() == encode(s)
    assert store.n_tokens == sum(map(len, seqs.values()))


def test_shipped_tiny_fasta_and_gzip_give_the_same_store(tmp_path: Path) -> None:
    a = fasta.prepare_fasta(TINY, tmp_path / "a")
    gz = tmp_path / "t.fasta.gz"
    gz.write_bytes(gzip.compress(TINY.read_bytes()))
    b = fasta.prepare_fasta(gz, tmp_path / "b")
    want = [encode(s) for s in read_fasta(TINY)]
    assert [a[i].tolist() for i in range(len(a))] == want
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert np.array_equal(
        np.fromfile(tmp_path / "a" / "idhash.bin", np.uint32),
        np.fromfile(tmp_path / "b" / "idhash.bin", np.uint32),
    )


def test_id_hash_depends_on_the_id_only(tmp_path: Path) -> None:
    s1 = _fasta(tmp_path / "1.fasta", {"A1": "ACD", "B2": "EEE", "C3": "K"})
    s2 = _fasta(tmp_path / "2.fasta", {"C3": "WWW", "A1": "ACDEF"})
    h1 = np.fromfile(fasta.prepare_fasta(s1, tmp_path / "x").path / "idhash.bin", np.uint32)
    h2 = np.fromfile(fasta.prepare_fasta(s2, tmp_path / "y").path / "idhash.bin", np.uint32)
    assert h1[0] == h2[1] and h1[2] == h2[0] and len(set(h1.tolist())) == 3


def test_split_is_a_deterministic_partition(tmp_path: Path) -> None:
    store = write_store(tmp_path / "s", ([i % 7] * (1 + i % 5) for i in range(5000)), "t", 7)
    tr, ev = (a.to_numpy() for a in store.split(0.1))
    both = np.concatenate([tr, ev])
    assert sorted(both.tolist()) == list(range(5000))
    assert 350 < len(ev) < 650  # about 10%
    tr2, ev2 = (a.to_numpy() for a in TokenStore(tmp_path / "s", "t").split(0.1))  # cached
    assert np.array_equal(ev, ev2) and np.array_equal(tr, tr2)
    assert not np.array_equal(store.split(0.1, salt=1)[1].to_numpy()[:50], ev[:50])


def test_writer_is_atomic(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), StoreWriter(tmp_path / "s", "t", 10) as w:
        w.add([1, 2, 3])
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []  # neither the store nor its temporary directory


def test_dataset_crops_pads_and_pickles_as_a_path(tmp_path: Path) -> None:
    """Reads stay exact-size (pread, only max_len tokens) and survive pickling (spawn)."""
    store = write_store(tmp_path / "s", [[1, 2, 3, 4, 5], [6], [7, 8, 9]], "t", 10)
    ds = TokenDataset(store, 3, pad=0, indices=store.split(0.0)[0])
    assert [ds[i].tolist() for i in range(3)] == [[1, 2, 3], [6, 0, 0], [7, 8, 9]]
    blob = pickle.dumps(ds)
    assert len(blob) < 2000  # the maps are not copied into the pickle
    assert pickle.loads(blob)[1].tolist() == [6, 0, 0]
    assert ds[0].dtype == torch.int64


# ---- bad inputs: one line naming the file and what was expected --------------------------
def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    binary = tmp / "bin.fasta"
    binary.write_bytes(bytes(range(256)) * 4)
    empty = tmp / "empty.fasta"
    empty.write_bytes(b"")
    pt = tmp / "processed_uniref50.pt"
    torch.save({"x": torch.arange(10)}, pt)
    trunc = tmp / "trunc"
    fasta.prepare_fasta(TINY, trunc)
    with open(trunc / "tokens.bin", "r+b") as fh:
        fh.truncate(100)
    other = tmp / "other"
    write_store(other, [[1, 2], [3]], "bpe-gpt2", 50257)
    text = tmp / "notes.txt"
    text.write_text("hello world\n")
    nohdr = tmp / "dir"
    nohdr.mkdir()
    return {
        "binary": (binary, "binary data"),
        "empty": (empty, "is empty"),
        "torch .pt of another shape": (pt, "seed 004's"),  # the seed's processed file is read
        "truncated store": (trunc, "truncated or damaged token store"),
        "other tokenizer": (other, "tokenizer 'bpe-gpt2'"),
        "text": (text, "not a FASTA '>' header"),
        "directory": (nohdr, "without header.json"),
        "missing": (tmp / "nope.fasta", "does not exist"),
    }


def test_bad_inputs_each_one_line_exit_2(tmp_path: Path) -> None:
    """Through `python -m ddp uniref50 --datafile X`: the whole user-facing path."""
    for name, (path, want) in _bad_inputs(tmp_path).items():
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddp",
                "uniref50",
                "--datafile",
                str(path),
                "--output_dir",
                str(tmp_path / "run"),
                "--max_steps",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=base_env(),
        )
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (name, out.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("ddp: error: recipe.data: "), (name, lines)
        assert str(path) in lines[0] and want in lines[0], (name, lines[0])
    assert zipfile.is_zipfile(tmp_path / "processed_uniref50.pt")


def test_prepare_cli_one_line_errors_and_no_half_store(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ddp.data", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=base_env(),
        )

    bad = tmp_path / "bad.fasta"
    bad.write_bytes(b">ok\n" + b"ACDE\n" * 500 + b">two\nAC\x00\x01DE\n")  # past the head check
    out = cli("prepare-fasta", str(bad), "--out", str(tmp_path / "st"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "control or non-ASCII byte" in out.stderr and str(bad) in out.stderr
    assert list(tmp_path.iterdir()) == [bad]  # no store, no temporary directory left
    good = cli("prepare-fasta", str(TINY), "--out", str(tmp_path / "st"))
    assert good.returncode == 0, good.stderr
    assert "prepare:" in good.stderr and "MB/s" in good.stderr  # plain progress lines
    header = json.loads((tmp_path / "st" / "header.json").read_text())
    assert header["tokenizer"] == fasta.TOKENIZER and header["n_seqs"] == 400
    again = cli("prepare-fasta", str(TINY), "--out", str(tmp_path / "st"))
    assert again.returncode == 2 and "exists" in again.stderr


def test_store_of_another_tokenizer_refused_in_python(tmp_path: Path) -> None:
    write_store(tmp_path / "s", [[1]], "bpe-gpt2", 50257)
    with pytest.raises(ConfigError, match="tokenizer 'bpe-gpt2'.*expected 'protein-aa20-v1'"):
        TokenStore(tmp_path / "s", fasta.TOKENIZER)


def test_fasta_is_prepared_once(tmp_path: Path, monkeypatch) -> None:
    src = _fasta(tmp_path / "a.fasta", _seqs(30))
    calls = []
    real = fasta.prepare_fasta
    monkeypatch.setattr(fasta, "prepare_fasta", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert fasta.resolve_store(src) == tmp_path / "a.fasta.tokens"
    fasta.resolve_store(src)
    assert len(calls) == 1
    src.write_text(src.read_text() + ">new\nAAAA\n")  # a changed file is prepared again
    fasta.resolve_store(src)
    assert len(calls) == 2 and TokenStore(tmp_path / "a.fasta.tokens").n_seqs == 31


def test_uniref50_trains_two_ranks_from_a_synthetic_fasta(tmp_path: Path) -> None:
    """The recipe on 2 Gloo ranks from a generated FASTA: rank 0 prepares the store beside
    it once (the other rank waits), both train from it; a second start prepares nothing."""
    src = tmp_path / "uniref50_synthetic.fasta"
    gen = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_fasta.py"),
            "--size",
            "2M",
            "--fasta",
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gen.returncode == 0, gen.stderr
    args = [
        "-m",
        "ddp",
        "uniref50",
        "--config",
        str(ROOT / "configs" / "uniref50-tiny.yaml"),
        "--datafile",
        str(src),
        "--max_steps",
        "6",
        "--set",
        "logging.every_n_steps=3",
        "logging.progress=plain",
        "training.batch_size=16",
    ]
    from tests.ddp import _launch

    for attempt in range(2):
        out = tmp_path / f"run{attempt}"
        results = _launch.run([*args, "--output_dir", str(out)], world=2, timeout=240)
        for rank, (rc, o, e) in enumerate(results):
            assert rc == 0, f"rank {rank}: {o[-2000:]}\n{e[-3000:]}"
        log = "".join(o + e for _, o, e in results)
        assert log.count("preparing ") == (1 if attempt == 0 else 0), log[-3000:]
        assert "world=2 effective batch=32" in log and (out / "final" / "model.pt").is_file()
    store = TokenStore(tmp_path / "uniref50_synthetic.fasta.tokens", fasta.TOKENIZER)
    assert store.n_seqs > 5000


def test_random_reads_do_not_grow_resident_memory(tmp_path: Path) -> None:
    """3000 random samples of a 64 MB store: resident memory stays within a few MB (a
    memory-mapped read would map a large page-cache folio per touch and grow by ~100 MB)."""
    n, length = 1_000_000, 64
    with StoreWriter(tmp_path / "s", "t", 25) as w:
        for _ in range(4):
            w.add_flat(np.full(n * length // 4, 7, np.uint8), np.full(n // 4, length))
    store = TokenStore(tmp_path / "s", "t")
    ds = TokenDataset(store, 32, indices=store.split(0.01)[0])

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    ds[0]
    before = rss()
    for i in np.random.default_rng(0).integers(0, len(ds), 3000):
        assert ds[int(i)][0] == 7
    assert rss() - before < 8 << 20, (rss() - before) / 2**20


def test_a_store_published_meanwhile_by_another_writer_wins(tmp_path: Path) -> None:
    """Two jobs preparing the same FASTA at once: the second rename finds the first's
    whole store and keeps it; no temporary directory is left behind."""
    with StoreWriter(tmp_path / "s", "t", 10) as w:
        w.add([1, 2])
        write_store(tmp_path / "s", [[3]], "t", 10)  # the other job, finishing first
    assert TokenStore(tmp_path / "s", "t").n_seqs == 1
    assert [p.name for p in tmp_path.iterdir()] == ["s"]
