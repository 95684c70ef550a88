"""ddp.data under careless and hostile input (issue 24).

Nothing is deleted that ddp.data did not write (``--force`` replaces only a token store,
never the input); what a store holds is checked (line endings, empty records, a store
with no tokens, a damaged header, a vocabulary that does not match its label); a bad
``.gz``, a full disk or a signal during preparation leaves nothing behind and says so in
one line; no reader of a store or a FASTA blocks on a named pipe; a read-only store
trains. Each case goes through the path a user takes (the CLI) where that is cheap.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from ddp.data import fasta
from ddp.data.dataset import TokenDataset
from ddp.data.store import TokenStore
from ddp.data.store_write import write_store
from ddp.errors import ConfigError
from ddp.recipes._common import encode
from ddp.recipes.uniref50 import read_fasta
from tests.ddp._launch import base_env
from tests.support.parts import require
from tests.support.signals import default_signals

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "src" / "ddp" / "recipes" / "data" / "uniref50_tiny.fasta"
TINY_CONFIG = str(ROOT / "configs" / "uniref50-tiny.yaml")  # the recipe's defaults are SEDD small
AA = np.frombuffer(b"ACDEFGHIKLMNPQRSTVWY", np.uint8)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m ddp.data ARGS`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "ddp.data", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env or base_env(),
    )


def train(
    data: Path, out: Path, *sets: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m ddp uniref50 --datafile DATA`` for a step or two."""
    cmd = [
        sys.executable,
        "-m",
        "ddp",
        "uniref50",
        "--config",
        TINY_CONFIG,
        "--datafile",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--set",
        "logging.progress=off",
        *sets,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env or base_env())


def one_line(out: subprocess.CompletedProcess, prefix: str) -> str:
    """The single stderr line of a refusal (exit 2), checked; ``prepare: ... MB/s``
    progress lines before it are no part of it."""
    lines = [ln for ln in out.stderr.strip().splitlines() if not ln.startswith("prepare: ")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    return lines[0]


def residues(n: int, seed: int = 0, width: int = 60) -> bytes:
    """A FASTA of ``n`` random records, 1-300 residues each, lines of ``width``."""
    rng = np.random.default_rng(seed)
    parts = []
    for i in range(n):
        seq = AA[rng.integers(0, 20, int(rng.integers(1, 300)))].tobytes()
        body = b"\n".join(seq[j : j + width] for j in range(0, len(seq), width))
        parts.append(b">R%d some description\n%s\n" % (i, body))
    return b"".join(parts)


def listing(path: Path) -> list[str]:
    """Every name under ``path``, hidden ones included (leftovers of a writer)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _mount_tmpfs(path: Path, options: str) -> None:
    require(os.geteuid() == 0, "mounting a tmpfs (a real full or read-only disk) needs root")
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    require(done.returncode == 0, f"mount -t tmpfs refused: {done.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MB filesystem: writes past it fail with ENOSPC, as on a full disk."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=1m")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def ro_store(tmp_path: Path) -> Iterator[Path]:
    """A store (of the shipped tiny FASTA) on a filesystem remounted read-only, without its
    split cache: a shared store that the user may read but not write (even as root)."""
    mnt = tmp_path / "shared"
    _mount_tmpfs(mnt, "size=4m")
    try:
        fasta.prepare_fasta(TINY, mnt / "tiny.tokens")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt / "tiny.tokens"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---- --force: only what ddp.data wrote, never the input ----------------------------------
def test_force_keeps_a_folder_that_is_not_a_store(tmp_path: Path) -> None:
    precious = tmp_path / "results"
    precious.mkdir()
    (precious / "notes.txt").write_text("a week of work\n")
    out = cli("prepare-fasta", str(TINY), "--out", str(precious), "--force")
    line = one_line(out, "ddp.data: error: ")
    assert str(precious) in line and "not a token store" in line and "--force" in line, line
    assert listing(tmp_path) == ["results", "results/notes.txt"]
    assert (precious / "notes.txt").read_text() == "a week of work\n"


def test_force_keeps_a_store_folder_that_holds_a_users_file(tmp_path: Path) -> None:
    """A store is replaced only while it holds nothing but what ddp.data writes."""
    st = tmp_path / "st"
    fasta.prepare_fasta(TINY, st)
    (st / "my_analysis.ipynb").write_text("{}")
    line = one_line(
        cli("prepare-fasta", str(TINY), "--out", str(st), "--force"), "ddp.data: error: "
    )
    assert "my_analysis.ipynb" in line, line
    assert (st / "my_analysis.ipynb").read_text() == "{}" and TokenStore(st).n_seqs == 400


@pytest.mark.parametrize("how", ["same path", "symlink to it", "folder holding it"])
def test_force_never_replaces_the_input(tmp_path: Path, how: str) -> None:
    src = tmp_path / "d" / "x.fasta"
    src.parent.mkdir()
    src.write_bytes(TINY.read_bytes())
    out = {"same path": src, "symlink to it": tmp_path / "link", "folder holding it": src.parent}[
        how
    ]
    if how == "symlink to it":
        out.symlink_to(src)
    before = listing(tmp_path)
    line = one_line(
        cli("prepare-fasta", str(src), "--out", str(out), "--force"), "ddp.data: error: "
    )
    assert "input" in line and str(src) in line, line
    assert listing(tmp_path) == before and src.read_bytes() == TINY.read_bytes()


def test_force_replaces_its_own_store_with_its_split_cache(tmp_path: Path) -> None:
    """What --force is for: a store ddp.data wrote (split cache included) is replaced whole."""
    st = tmp_path / "st"
    fasta.prepare_fasta(TINY, st).split(0.1)
    src = tmp_path / "b.fasta"
    src.write_bytes(b">a\nACDE\n>b\nKK\n")
    out = cli("prepare-fasta", str(src), "--out", str(st), "--force")
    assert out.returncode == 0, out.stderr
    assert TokenStore(st).n_seqs == 2 and listing(tmp_path) == [
        "b.fasta",
        "st",
        "st/header.json",
        "st/idhash.bin",
        "st/offsets.bin",
        "st/tokens.bin",
    ]


def test_an_empty_folder_made_for_the_output_is_filled(tmp_path: Path) -> None:
    """Nothing to lose there (as git clone fills an empty folder): no --force needed."""
    (tmp_path / "st").mkdir()
    out = cli("prepare-fasta", str(TINY), "--out", str(tmp_path / "st"))
    assert out.returncode == 0, out.stderr
    assert TokenStore(tmp_path / "st").n_seqs == 400 and listing(tmp_path)[0] == "st"


def test_datafile_never_replaces_a_users_folder_named_like_its_store(tmp_path: Path) -> None:
    """--datafile X.fasta prepares into X.fasta.tokens: a folder of the user's there stays."""
    src = tmp_path / "x.fasta"
    src.write_bytes(TINY.read_bytes())
    mine = tmp_path / "x.fasta.tokens"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a token store") as err:
        fasta.resolve_store(src)
    assert "\n" not in str(err.value) and str(mine) in str(err.value)
    assert listing(tmp_path) == ["x.fasta", "x.fasta.tokens", "x.fasta.tokens/keep.txt"]


def test_out_below_a_regular_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_text("x")
    line = one_line(
        cli("prepare-fasta", str(TINY), "--out", str(tmp_path / "file.txt" / "st")),
        "ddp.data: error: ",
    )
    assert "file.txt" in line and "cannot write" in line, line
    assert listing(tmp_path) == ["file.txt"]


# ---- what a FASTA holds: line endings, empty records, no residues at all -----------------
@pytest.mark.parametrize("chunk", [16, 1 << 20])
@pytest.mark.parametrize("nl", [b"\r", b"\r\n", b"\n", b"mixed"])
def test_every_line_ending_gives_the_same_store(
    tmp_path: Path, monkeypatch, chunk: int, nl: bytes
) -> None:
    """CR (classic Mac), CRLF (Windows), LF and a mix of them: one store, as Python's
    ``splitlines`` reads the file; CRs cut across chunk boundaries too."""
    monkeypatch.setattr(fasta, "CHUNK", chunk)
    text = residues(60, width=13)
    if nl == b"mixed":
        lines = text.split(b"\n")
        ends = [b"\r", b"\r\n", b"\n"]
        text = b"".join(ln + ends[i % 3] for i, ln in enumerate(lines[:-1]))
    else:
        text = text.replace(b"\n", nl)
    src = tmp_path / "a.fasta"
    src.write_bytes(text)
    store = fasta.prepare_fasta(src, tmp_path / "st")
    want = [encode(s) for s in read_fasta(src)]
    assert store.n_seqs == len(want) == 60
    assert [store[i].tolist() for i in range(store.n_seqs)] == want


def test_a_line_past_the_bound_is_one_line_not_unbounded_memory(
    tmp_path: Path, monkeypatch
) -> None:
    """A line is held whole until its end: a huge one (a genome, a file with no newline)
    stops at the bound instead of growing memory with the file."""
    monkeypatch.setattr(fasta, "CHUNK", 1 << 10)
    monkeypatch.setattr(fasta, "MAX_LINE", 1 << 14, raising=False)
    src = tmp_path / "long.fasta"
    src.write_bytes(b">a\nACDE\n>chr1\n" + b"ACGT" * (1 << 13) + b"\n")
    with pytest.raises(ConfigError, match="line at byte 14 is longer than 16,384 bytes"):
        fasta.prepare_fasta(src, tmp_path / "st")
    assert listing(tmp_path) == ["long.fasta"]
    src.write_bytes(b">a\nACDE\n>b\n" + b"ACGT" * (1 << 11) + b"\n")  # 8 KB: fine
    assert fasta.prepare_fasta(src, tmp_path / "st")[1].tolist() == encode("ACGT" * (1 << 11))


def test_empty_records_are_skipped_with_a_one_line_note(tmp_path: Path) -> None:
    src = tmp_path / "e.fasta"
    src.write_bytes(b">empty1\n>a\nACDE\n>empty2 desc\n\n>b\nKKW\n>empty3\n")
    out = cli("prepare-fasta", str(src))
    assert out.returncode == 0, out.stderr
    notes = [ln for ln in out.stderr.splitlines() if "empty" in ln]
    assert len(notes) == 1 and "3 empty records" in notes[0] and "of 5" in notes[0], out.stderr
    store = TokenStore(tmp_path / "e.fasta.tokens")
    assert [store[i].tolist() for i in range(len(store))] == [encode("ACDE"), encode("KKW")]


def test_empty_records_do_not_make_eval_loss_nan(tmp_path: Path) -> None:
    """Half the records empty: training and evaluation see only real sequences."""
    rng = np.random.default_rng(1)
    text = b"".join(
        b">s%d\n%s\n" % (i, AA[rng.integers(0, 20, 30)].tobytes() if i % 2 else b"")
        for i in range(200)
    )
    src = tmp_path / "e.fasta"
    src.write_bytes(text)
    out = train(src, tmp_path / "run")
    assert out.returncode == 0, out.stderr[-3000:]
    done = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("done:")]
    assert done and "eval_loss=nan" not in done[0] and "eval_loss=" in done[0], done


def test_headers_only_fasta_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "h.fasta"
    src.write_bytes(b">a\n>b desc\n\n>c\n")
    line = one_line(cli("prepare-fasta", str(src)), "ddp.data: error: ")
    assert str(src) in line and "no residues" in line, line
    line = one_line(train(src, tmp_path / "run"), "ddp: error: recipe.data: ")
    assert str(src) in line and "no residues" in line, line
    assert listing(tmp_path) == ["h.fasta"]


def _hand_made_store(
    path: Path, seqs: list[list[int]], vocab: int = fasta.VOCAB_SIZE, header: dict | None = None
) -> Path:
    """A store written file by file (as an older ddp.data or another tool could have)."""
    path.mkdir()
    tokens = np.array([t for s in seqs for t in s], np.uint8)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    idhash = np.arange(len(seqs), dtype=np.uint32) * np.uint32(2654435761)
    for name, arr in (("tokens.bin", tokens), ("offsets.bin", offsets), ("idhash.bin", idhash)):
        (path / name).write_bytes(arr.tobytes())
    h = {
        "format": 1,
        "tokenizer": fasta.TOKENIZER,
        "vocab_size": vocab,
        "dtype": "uint8",
        "n_seqs": len(seqs),
        "n_tokens": len(tokens),
        "source": "",
        "bytes": {
            n: (path / n).stat().st_size for n in ("tokens.bin", "offsets.bin", "idhash.bin")
        },
    }
    h.update(header or {})
    (path / "header.json").write_text(json.dumps(h))
    return path


def test_a_store_without_tokens_is_refused_at_training_start(tmp_path: Path) -> None:
    st = _hand_made_store(tmp_path / "st", [[], [], []])
    line = one_line(train(st, tmp_path / "run"), "ddp: error: recipe.data: ")
    assert str(st) in line and "no tokens" in line, line
    with pytest.raises(ConfigError, match="no tokens"):
        write_store(tmp_path / "w", [[], []], "t", 10)
    assert not (tmp_path / "w").exists()


def test_empty_sequences_of_a_store_stay_out_of_both_splits(tmp_path: Path) -> None:
    st = _hand_made_store(tmp_path / "st", [[5, 6], [], [7], []] * 50)
    tr, ev = (a.to_numpy() for a in TokenStore(st).split(0.2))
    kept = sorted(np.concatenate([tr, ev]).tolist())
    assert kept == [i for i in range(200) if i % 4 in (0, 2)] and len(ev) > 0


# ---- gzip: truncated, corrupt, trailing garbage ------------------------------------------
def _bad_gzips(tmp: Path) -> dict[str, Path]:
    data = gzip.compress(residues(8000, seed=2), compresslevel=1)  # ~1.2 MB: past the head check
    cases = {
        "truncated": data[: len(data) * 6 // 10],
        "bad crc": data[:-8] + bytes(b ^ 0xFF for b in data[-8:-4]) + data[-4:],
        "trailing garbage": data + b"garbage!",
    }
    out = {}
    for name, blob in cases.items():
        p = tmp / f"{name.replace(' ', '_')}.fasta.gz"
        p.write_bytes(blob)
        out[name] = p
    return out


def test_bad_gzip_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    bad = _bad_gzips(tmp_path)
    before = listing(tmp_path)
    for name, src in bad.items():
        line = one_line(cli("prepare-fasta", str(src)), "ddp.data: error: ")
        assert str(src) in line and "gzip" in line, (name, line)
        assert listing(tmp_path) == before, name
    line = one_line(train(bad["truncated"], tmp_path / "run"), "ddp: error: recipe.data: ")
    assert "gzip" in line and str(bad["truncated"]) in line, line
    assert not [p for p in listing(tmp_path) if "tokens" in p], listing(tmp_path)


# ---- a damaged header: one line, whatever is in it ---------------------------------------
DAMAGED = {
    "truncated json": b'{"format": 1, "tokeni',
    "a list": b"[]",
    "not utf-8": b'{"format": 1, "tokenizer": "\xff\xfe"}',
    "deep nesting": b"[" * 100_000,
    "n_seqs NaN": {"n_seqs": float("nan")},
    "n_seqs a string": {"n_seqs": "abc"},
    "n_seqs huge": {"n_seqs": 10**30},
    "n_seqs negative": {"n_seqs": -1},
    "n_tokens bool": {"n_tokens": True},
    "n_tokens float": {"n_tokens": 3.5},
    "vocab_size zero": {"vocab_size": 0},
    "vocab_size string": {"vocab_size": "25"},
    "dtype object": {"dtype": "object"},
    "dtype float": {"dtype": "float64"},
    "dtype too small": {"dtype": "uint8", "vocab_size": 50000},
    "bytes a list": {"bytes": []},
    "bytes other file": {"bytes": {"../../etc/passwd": 1}},
    "bytes missing": {"bytes": None},
    "format 2": {"format": 2},
    "tokenizer a number": {"tokenizer": 7},
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_header_is_one_line(tmp_path: Path, case: str) -> None:
    st = _hand_made_store(tmp_path / "st", [[5, 6, 7], [8]], vocab=25)
    change = DAMAGED[case]
    if isinstance(change, bytes):
        (st / "header.json").write_bytes(change)
    else:
        h = json.loads((st / "header.json").read_text())
        h.update(change)
        (st / "header.json").write_text(json.dumps(h))
    with pytest.raises(ConfigError) as err:
        TokenStore(st, fasta.TOKENIZER)
    msg = str(err.value)
    assert "\n" not in msg and str(st) in msg and len(msg) < 400, msg


def test_huge_header_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    st = _hand_made_store(tmp_path / "st", [[5]])
    with open(st / "header.json", "r+b") as fh:
        fh.truncate(64 << 20)  # sparse: 64 MB of zeros
    with pytest.raises(ConfigError, match="header.json.*bytes"):
        TokenStore(st)


def test_offsets_that_do_not_start_at_zero_are_refused(tmp_path: Path) -> None:
    st = _hand_made_store(tmp_path / "st", [[5, 6], [7]])
    off = np.fromfile(st / "offsets.bin", np.int64)
    off[0] = 1
    off.tofile(st / "offsets.bin")
    with pytest.raises(ConfigError, match="offsets"):
        TokenStore(st)


def test_offsets_out_of_order_are_refused_on_read(tmp_path: Path) -> None:
    st = _hand_made_store(tmp_path / "st", [[5, 6], [7], [8, 9, 10]])
    off = np.fromfile(st / "offsets.bin", np.int64)
    off[1], off[2] = 3, 1  # sequence 0 runs past sequence 1's start; sequence 1 backwards
    off.tofile(st / "offsets.bin")
    store = TokenStore(st)
    with pytest.raises(ConfigError, match="damaged.*sequence 1"):
        store.read(1)


def test_damaged_header_through_the_cli(tmp_path: Path) -> None:
    st = _hand_made_store(tmp_path / "st", [[5, 6, 7]], header={"n_seqs": "abc"})
    line = one_line(train(st, tmp_path / "run"), "ddp: error: recipe.data: ")
    assert str(st) in line and "n_seqs" in line, line


# ---- vocabulary vs label -----------------------------------------------------------------
def test_store_whose_vocabulary_does_not_match_its_label_is_refused_at_open(tmp_path: Path) -> None:
    st = tmp_path / "st"
    write_store(st, [[1, 2, 30000]] * 40, fasta.TOKENIZER, 50257)
    line = one_line(train(st, tmp_path / "run"), "ddp: error: recipe.data: ")
    assert fasta.TOKENIZER in line and "50257" in line and str(fasta.VOCAB_SIZE) in line, line


def test_token_ids_past_the_vocabulary_are_refused_on_read(tmp_path: Path) -> None:
    st = _hand_made_store(tmp_path / "st", [[5, 6, 200], [7]])
    ds = TokenDataset(TokenStore(st, fasta.TOKENIZER, fasta.VOCAB_SIZE), 8)
    assert ds[1][0] == 7
    with pytest.raises(ConfigError, match="token id 200.*vocab_size 25"):
        ds[0]


def test_damaged_split_cache_is_refused(tmp_path: Path) -> None:
    st = fasta.prepare_fasta(TINY, tmp_path / "st")
    tr, ev = st.split(0.1)
    np.array([0, 1, 10**6], np.uint32).tofile(tr.path)  # an index past the store
    tr2, _ = TokenStore(st.path).split(0.1)
    with pytest.raises(ConfigError, match="split"):
        TokenDataset(st, 8, indices=tr2)[2]
    (tr.path).write_bytes(b"\x01\x02\x03")  # not a whole number of entries
    with pytest.raises(ConfigError, match="split"):
        TokenStore(st.path).split(0.1)


# ---- a read-only shared store ------------------------------------------------------------
def test_read_only_store_without_split_cache_trains(tmp_path: Path, ro_store: Path) -> None:
    before = listing(ro_store)
    env = base_env()
    env["DDP_DATA_CACHE"] = str(tmp_path / "cache")
    out = train(ro_store, tmp_path / "run", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert listing(ro_store) == before
    assert any(p.endswith(".eval.bin") for p in listing(tmp_path / "cache")), listing(tmp_path)


def test_read_only_store_split_equals_the_writable_one(tmp_path: Path, ro_store: Path) -> None:
    want = [a.to_numpy() for a in fasta.prepare_fasta(TINY, tmp_path / "w").split(0.1)]
    for cache in (tmp_path / "cache", ro_store.parent / "cache"):  # the second is read-only too
        got = TokenStore(ro_store).split(0.1, cache=cache)
        assert all(
            np.array_equal(np.asarray(g if isinstance(g, np.ndarray) else g.to_numpy()), w)
            for g, w in zip(got, want, strict=True)
        )


# ---- signals and a full disk -------------------------------------------------------------
_BLOCKING_PREPARE = textwrap.dedent("""
    import os, sys
    import ddp.data.fasta as fasta
    from ddp.data.__main__ import main

    class Stop:  # the first progress report: say so, then wait until signalled
        def __init__(self, emit, every_s=5.0):
            pass
        def __call__(self, done, total):
            print("ready", flush=True)
            sys.stdin.read()

    fasta.PlainProgress = Stop
    fasta.CHUNK = 1 << 16
    sys.exit(main(sys.argv[1:]))
""")


def _blocking_prepare(src: Path, out: Path, preexec: Callable[[], None]) -> subprocess.Popen[str]:
    """``prepare-fasta SRC --out OUT`` in a child that prints ``ready`` and blocks
    mid-write (``_BLOCKING_PREPARE``), its signals set by ``preexec``."""
    return subprocess.Popen(
        [sys.executable, "-c", _BLOCKING_PREPARE, "prepare-fasta", str(src), "--out", str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=base_env(),
        preexec_fn=preexec,
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_during_prepare_leaves_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    src = tmp_path / "a.fasta"
    src.write_bytes(residues(2000))
    proc = _blocking_prepare(src, tmp_path / "st", default_signals)
    try:
        assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=60)
        assert [p for p in listing(tmp_path) if ".st.tmp-" in p], listing(tmp_path)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and sig.name in lines[0], lines
    assert listing(tmp_path) == ["a.fasta"]


def test_an_ignored_sighup_stays_ignored_during_prepare(tmp_path: Path) -> None:
    """Under nohup (SIGHUP ignored at start) a hang-up must not stop the preparation:
    the store's signal guard takes over only signals still at their default."""
    src = tmp_path / "a.fasta"
    src.write_bytes(residues(2000))

    def nohup() -> None:
        default_signals()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = _blocking_prepare(src, tmp_path / "st", nohup)
    try:
        assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=60)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(input="", timeout=120)  # stdin's end lets it go on
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert len(TokenStore(tmp_path / "st")) > 0
    assert not [p for p in listing(tmp_path) if ".st.tmp-" in p], listing(tmp_path)


_BLOCKING_TRAIN = _BLOCKING_PREPARE.replace(
    "from ddp.data.__main__ import main", "from ddp.__main__ import main"
)


def test_signal_while_a_training_job_prepares_its_store(tmp_path: Path) -> None:
    """--datafile FASTA: the job is stopped while rank 0 prepares; it still ends by the
    signal (as the scheduler expects), with a warning and no temporary store left."""
    src = tmp_path / "a.fasta"
    src.write_bytes(residues(2000))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _BLOCKING_TRAIN,
            "uniref50",
            "--config",
            TINY_CONFIG,
            "--datafile",
            str(src),
            "--output_dir",
            str(tmp_path / "run"),
            "--max_steps",
            "1",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=base_env(),
    )
    try:
        seen = []
        while not seen or seen[-1] not in ("ready\n", ""):  # log lines come first
            seen.append(proc.stdout.readline())
        assert seen[-1] == "ready\n", (seen, proc.communicate(timeout=60))
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err)
    assert "Traceback" not in err and "SIGTERM while preparing" in out + err, (out, err)
    assert not [p for p in listing(tmp_path) if "tokens" in p], listing(tmp_path)


_SIGNAL_WHILE_PUBLISHING = textwrap.dedent("""
    import os, signal, sys
    import ddp.data.store as store
    from ddp.data.__main__ import main

    real = os.replace
    def replace(a, b):  # SIGTERM arrives while the new store is being swapped in
        os.kill(os.getpid(), signal.SIGTERM)
        return real(a, b)

    store.os.replace = replace
    sys.exit(main(sys.argv[1:]))
""")


def test_signal_while_publishing_waits_until_the_store_is_whole(tmp_path: Path) -> None:
    """--force: the old store is never lost half-way; the signal takes effect once the new
    store is in place (the process still ends by it)."""
    st = tmp_path / "st"
    write_store(st, [[1, 2]], fasta.TOKENIZER, fasta.VOCAB_SIZE)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _SIGNAL_WHILE_PUBLISHING,
            "prepare-fasta",
            str(TINY),
            "--out",
            str(st),
            "--force",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=base_env(),
    )
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stderr)
    assert TokenStore(st, fasta.TOKENIZER).n_seqs == 400
    assert listing(tmp_path) == [
        "st",
        "st/header.json",
        "st/idhash.bin",
        "st/offsets.bin",
        "st/tokens.bin",
    ]


def test_full_disk_during_prepare_is_one_line_and_leaves_nothing(
    tmp_path: Path, tmpfs: Path
) -> None:
    src = tmp_path / "big.fasta"
    src.write_bytes(residues(20000))  # ~3 MB of residues into 1 MB
    line = one_line(cli("prepare-fasta", str(src), "--out", str(tmpfs / "st")), "ddp.data: error: ")
    assert "no space left" in line and str(tmpfs / "st") in line, line
    assert listing(tmpfs) == []


# ---- named pipes, loops: no reader blocks ------------------------------------------------
def _run_bounded(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a child with a bound against a true hang (a reader blocked on a pipe)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=base_env(),
    )


@pytest.mark.parametrize("name", ["header.json", "tokens.bin", "idhash.bin"])
def test_store_file_that_is_a_named_pipe_is_refused(tmp_path: Path, name: str) -> None:
    st = _hand_made_store(tmp_path / "st", [[5, 6], [7]])
    (st / name).unlink()
    os.mkfifo(st / name)
    out = _run_bounded(
        "import sys\nfrom ddp.data.store import TokenStore\n"
        "from ddp.errors import ConfigError\n"
        "try:\n    TokenStore(sys.argv[1]).split(0.5)\n"
        "except ConfigError as e:\n    print(e)\n",
        str(st),
    )
    assert out.returncode == 0 and "named pipe" in out.stdout and name in out.stdout, out


def test_split_cache_that_is_a_named_pipe_is_refused(tmp_path: Path) -> None:
    st = fasta.prepare_fasta(TINY, tmp_path / "st")
    tr, _ = st.split(0.1)
    tr.path.unlink()
    os.mkfifo(tr.path)
    out = _run_bounded(
        "import sys\nfrom ddp.data.store import TokenStore\n"
        "from ddp.errors import ConfigError\n"
        "try:\n    print(len(TokenStore(sys.argv[1]).split(0.1)[0]))\n"
        "except ConfigError as e:\n    print(e)\n",
        str(st.path),
    )
    assert out.returncode == 0 and "named pipe" in out.stdout, out


def test_fasta_that_is_a_named_pipe_or_a_loop_is_one_line(tmp_path: Path) -> None:
    pipe = tmp_path / "in.fasta"
    os.mkfifo(pipe)
    line = one_line(cli("prepare-fasta", str(pipe)), "ddp.data: error: ")
    assert "named pipe" in line and str(pipe) in line, line
    loop = tmp_path / "loop.fasta"
    loop.symlink_to(loop)
    line = one_line(cli("prepare-fasta", str(loop)), "ddp.data: error: ")
    assert str(loop) in line and "symbolic links" in line, line


def test_current_check_does_not_block_on_a_pipe_header(tmp_path: Path) -> None:
    src = tmp_path / "x.fasta"
    src.write_bytes(TINY.read_bytes())
    st = tmp_path / "x.fasta.tokens"
    st.mkdir()
    os.mkfifo(st / "header.json")
    out = _run_bounded(
        "import sys\nfrom pathlib import Path\nfrom ddp.data import fasta\n"
        "print(fasta.is_current(Path(sys.argv[1]), Path(sys.argv[2])))\n",
        str(st),
        str(src),
    )
    assert out.returncode == 0 and out.stdout.strip() == "False", out


# ---- the recipe's own data settings ------------------------------------------------------
@pytest.mark.parametrize(
    "setting",
    ["recipe.split_salt=-1", "recipe.split_salt=" + "9" * 30, "recipe.eval_fraction=null"],
)
def test_split_settings_out_of_range_are_one_line(tmp_path: Path, setting: str) -> None:
    src = tmp_path / "x.fasta"
    src.write_bytes(TINY.read_bytes())
    line = one_line(train(src, tmp_path / "run", setting), "ddp: error: recipe.")
    assert setting.split("=")[0] in line, line
