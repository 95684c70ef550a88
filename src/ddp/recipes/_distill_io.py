"""The distill recipe's inputs: text corpora as users have them, and the teacher cache.

Kept apart from :mod:`ddp.recipes.distill` so the training code reads as the loss and
the export, and so the cache's rules (what keys it, when it is refused) are in one place.

Corpora (:func:`read_corpus`): one text per line, JSON Lines with a text field,
Parquet (pyarrow), or a local Hugging Face dataset folder (``save_to_disk``). A
held-out file whose records have ``query`` and ``positive`` fields is a set of
retrieval pairs (:class:`Corpus.positives`).

Teacher cache (:func:`teacher_embeddings`): the teacher is frozen, so its embedding of a
text never changes; computing it once turns every later phase, epoch and resume into a
read. Each rank encodes a contiguous shard, rank 0 joins the shards into one file under
the run directory, and a JSON key beside it says what the numbers are the teacher's
embeddings *of*. A cache whose key differs (another teacher, corpus or max length) is
refused, not rebuilt: the same run directory also holds the student's checkpoints,
which were trained against that other target, and resuming them against a new one
would mix two runs silently. A cache that merely covers fewer texts than this run
needs (a larger ``max_samples``) is rebuilt, with a line saying so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ddp
from ddp.checkpoint import atomic_save, atomic_write_text
from ddp.errors import ConfigError
from hpc_ddp import files as _files

log = logging.getLogger("ddp")

EXTRA = "pip install 'hpc-ddp[distill]'"
KEY_VERSION = 1
#: At most this many bytes of one JSON line / text line (a binary file is not a corpus).
MAX_LINE = 1 << 20


@dataclass
class Corpus:
    """Texts in file order; ``positives`` is set for a file of (query, positive) pairs."""

    path: str
    texts: list[str]
    positives: list[str] | None = None
    digest: str = field(default="")

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = digest_texts(self.texts, self.positives)


def digest_texts(texts: list[str], positives: list[str] | None = None) -> str:
    """sha256 over the texts (and positives): the corpus part of the cache key.

    Over the texts, not the file, so that the same corpus as .txt or .parquet shares a
    cache, and an edit of one line anywhere changes the key."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    if positives is not None:
        h.update(b"\1pairs\1")
        for t in positives:
            h.update(t.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
    return h.hexdigest()


# ---- corpora -------------------------------------------------------------------------------
def read_corpus(path: str, text_field: str, what: str, pairs_allowed: bool = False) -> Corpus:
    """The texts of ``path`` (``what``: the flag, for errors); one ConfigError line on bad input."""
    p = Path(path)
    if p.is_dir():
        records = _hf_dataset(p, what)
        kind = "a Hugging Face dataset folder"
    elif p.suffix == ".parquet":
        records = _parquet(p, what)
        kind = "Parquet"
    elif p.suffix in (".jsonl", ".json"):
        records = _jsonl(p, what)
        kind = "JSON Lines"
    else:
        texts = _lines(p, what)
        if not texts:
            raise ConfigError(f"{what}: {path} has no non-empty line; allowed: one text per line")
        return Corpus(path, texts)
    if not records:
        raise ConfigError(f"{what}: {path} ({kind}) has no records")
    first = records[0]
    if pairs_allowed and "positive" in first and ("query" in first or "anchor" in first):
        q = "query" if "query" in first else "anchor"
        queries = [_field(r, q, i, path, what) for i, r in enumerate(records)]
        positives = [_field(r, "positive", i, path, what) for i, r in enumerate(records)]
        return Corpus(path, queries, positives)
    texts = [_field(r, text_field, i, path, what) for i, r in enumerate(records)]
    return Corpus(path, texts)


def _field(record: Any, name: str, i: int, path: str, what: str) -> str:
    if not isinstance(record, dict) or name not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            f"{what}: record {i + 1} of {path} has no {name!r} field (has "
            f"{keys}); allowed: set recipe.text_field to the text's field"
        )
    value = record[name]
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{what}: record {i + 1} of {path}: {name!r} is {value!r:.60}; "
            "allowed: a non-empty string"
        )
    return value


def _read(p: Path, what: str) -> bytes:
    try:
        data, _ = _files.read_regular(p, None)
    except _files.NotRegular as exc:
        raise ConfigError(f"{what}: {p} {exc}") from None
    return data


def _decoded_lines(p: Path, what: str) -> list[str]:
    data = _read(p, what)
    if b"\0" in data[:65536]:
        raise ConfigError(
            f"{what}: {p} is binary (a NUL byte); allowed: UTF-8 text, "
            ".jsonl, .parquet or a dataset folder"
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        number = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{what}: {p} line {number} is not UTF-8; allowed: UTF-8 text") from None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if len(line) > MAX_LINE:
            raise ConfigError(
                f"{what}: {p} line {i + 1} is {len(line):,} characters; "
                f"allowed: at most {MAX_LINE:,}"
            )
    return lines


def _lines(p: Path, what: str) -> list[str]:
    return [s for s in (line.strip() for line in _decoded_lines(p, what)) if s]


def _jsonl(p: Path, what: str) -> list[Any]:
    out = []
    for i, line in enumerate(_decoded_lines(p, what)):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{what}: {p} line {i + 1} is not JSON ({exc.msg}); allowed: "
                "one JSON object per line"
            ) from None
    return out


def _parquet(p: Path, what: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{what}: reading Parquet needs pyarrow: {EXTRA}") from None
    try:
        fd, _ = _files.open_regular(p)
    except _files.NotRegular as exc:
        raise ConfigError(f"{what}: {p} {exc}") from None
    try:
        with os.fdopen(fd, "rb") as fh:
            table = pq.read_table(fh)
    except Exception as exc:  # pyarrow's errors (ArrowInvalid, ...) for a bad file
        raise ConfigError(f"{what}: {p} is not a readable Parquet file ({exc})"[:300]) from None
    return table.to_pylist()


def _hf_dataset(p: Path, what: str) -> list[dict[str, Any]]:
    marks = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes
    if not any((p / m).is_file() for m in marks):
        raise ConfigError(
            f"{what}: {p} is a folder but not a saved Hugging Face dataset; "
            "allowed: a text, .jsonl or .parquet file, or a save_to_disk folder"
        )
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{what}: {p} is a Hugging Face dataset: pip install datasets") from None
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ConfigError(f"{what}: {p} has splits {sorted(ds)}; allowed: one with 'train'")
        ds = ds["train"]
    return list(ds)


# ---- the teacher cache ----------------------------------------------------------------------
def teacher_identity(name: str) -> dict[str, Any]:
    """What names the teacher in the key: the hub id, or a local folder and its files.

    A local folder is fingerprinted by its files' names, sizes and mtimes (not their
    bytes: a 7B teacher would take minutes to hash), so retraining the teacher in place
    changes the key."""
    p = Path(name)
    if not p.is_dir():
        return {"teacher": name}
    files = []
    for f in sorted(p.rglob("*")):
        if f.is_file() and not f.name.startswith("."):
            st = f.stat()
            files.append([str(f.relative_to(p)), st.st_size, st.st_mtime_ns])
    return {"teacher": str(p.resolve()), "files": files}


def cache_key(teacher: str, dtype: str, max_len: int | None, corpus: Corpus) -> dict[str, Any]:
    return {
        "version": KEY_VERSION,
        **teacher_identity(teacher),
        "dtype": dtype,
        "max_seq_length": max_len,
        "corpus": corpus.digest,
    }


def _describe(key: dict[str, Any]) -> str:
    return (
        f"teacher {key.get('teacher')!r}, corpus sha256 {str(key.get('corpus'))[:12]}, "
        f"max_seq_length {key.get('max_seq_length')}, dtype {key.get('dtype')}"
    )


def _decide(meta_path: Path, emb_path: Path, key: dict[str, Any], rows: int) -> tuple[str, str]:
    """Rank 0's verdict on an existing cache: ("build"|"reuse"|"refuse", why)."""
    if not meta_path.exists():
        return "build", "no cache yet"
    try:
        raw, _ = _files.read_regular(meta_path, 1 << 20, follow=False)
        meta = json.loads(raw)
        old = meta["key"]
        old_rows = int(meta["rows"])
    except (_files.NotRegular, ValueError, KeyError, TypeError) as exc:
        return "refuse", (
            f"teacher cache {meta_path} is unreadable ({exc}); allowed: a cache "
            "this recipe wrote; delete the folder to rebuild it"
        )
    if old != key:
        return "refuse", (
            f"teacher cache {meta_path.parent} holds embeddings of {_describe(old)}; this run "
            f"has {_describe(key)}; allowed: the same teacher, corpus and max length as the "
            "run directory's, or another --output_dir (its checkpoints were trained against "
            "that cache)"
        )
    if not emb_path.exists():
        return "build", f"{emb_path.name} is missing"
    if old_rows < rows:
        return "build", f"the cache holds {old_rows} texts and this run needs {rows}"
    return "reuse", f"{old_rows} texts"


def teacher_embeddings(
    directory: Path | None,
    name: str,
    key: dict[str, Any],
    texts: list[str],
    encode: Callable[[list[str]], torch.Tensor],
) -> torch.Tensor:
    """The teacher's embeddings of ``texts`` (rows in order), computed once per run dir.

    Collective: every rank calls it with the same arguments. ``encode`` (loading the
    teacher on first use) runs only when the cache must be built, each rank on its
    contiguous shard. ``directory`` None: computed in memory, sharded just the same.
    """
    rank, world = ddp.get_rank(), ddp.get_world_size()
    rows = len(texts)
    if directory is None:
        return _gather_in_memory(texts, encode, rank, world)
    emb_path, meta_path = directory / f"{name}.pt", directory / f"{name}.json"
    verdict, why = ("", "")
    if rank == 0:
        verdict, why = _decide(meta_path, emb_path, key, rows)
    verdict, why = ddp.broadcast_object((verdict, why))
    if verdict == "refuse":
        raise ConfigError(why)
    if verdict == "build":
        log.info(
            "teacher cache %s: computing %d embeddings on %d rank(s) (%s)",
            emb_path,
            rows,
            world,
            why,
        )
        _build(directory, name, key, texts, encode, rank, world)
    else:
        log.info("teacher cache %s: reused (%s)", emb_path, why)
    return _load(emb_path, rows)


def _shard(rows: int, rank: int, world: int) -> range:
    return range(rows * rank // world, rows * (rank + 1) // world)


def _encode_shard(
    texts: list[str], encode: Callable[[list[str]], torch.Tensor], rank: int, world: int
) -> torch.Tensor | None:
    own = _shard(len(texts), rank, world)
    return encode([texts[i] for i in own]).detach().cpu() if len(own) else None


def _collect_errors(error: str | None) -> None:
    """Every rank learns the first rank's failure (no rank is left waiting at a barrier)."""
    errors = ddp.all_gather_object(error)
    first = next((e for e in errors if e), None)
    if first:
        raise ConfigError(first)


def _build(
    directory: Path,
    name: str,
    key: dict[str, Any],
    texts: list[str],
    encode: Callable[[list[str]], torch.Tensor],
    rank: int,
    world: int,
) -> None:
    shard_path = directory / f"{name}.shard-{rank}-of-{world}.pt"
    error = None
    t0 = time.perf_counter()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        emb = _encode_shard(texts, encode, rank, world)
        if emb is not None:
            atomic_save(emb, shard_path, durable=False)
    except ConfigError as exc:
        error = str(exc)
    except OSError as exc:
        error = f"teacher cache {shard_path}: cannot write ({exc.strerror or exc})"
    _collect_errors(error)
    error = None
    if rank == 0:
        try:
            parts = []
            for r in range(world):
                if len(_shard(len(texts), r, world)):
                    p = directory / f"{name}.shard-{r}-of-{world}.pt"
                    parts.append(torch.load(p, map_location="cpu", weights_only=True))
            full = torch.cat(parts)
            if full.shape[0] != len(texts):
                raise ConfigError(f"teacher cache: {full.shape[0]} rows for {len(texts)} texts")
            atomic_save(full, directory / f"{name}.pt")
            meta = {
                "key": key,
                "rows": len(texts),
                "dim": int(full.shape[1]),
                "dtype": str(full.dtype),
                "built_s": round(time.perf_counter() - t0, 3),
            }
            # The key lands last: it is what says the cache is complete.
            atomic_write_text(json.dumps(meta, indent=1) + "\n", directory / f"{name}.json")
            for r in range(world):
                (directory / f"{name}.shard-{r}-of-{world}.pt").unlink(missing_ok=True)
        except ConfigError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"teacher cache {directory}: cannot write ({exc.strerror or exc})"
    _collect_errors(error)


def _gather_in_memory(
    texts: list[str], encode: Callable[[list[str]], torch.Tensor], rank: int, world: int
) -> torch.Tensor:
    emb = _encode_shard(texts, encode, rank, world)
    parts = ddp.all_gather_object(emb)
    return torch.cat([p for p in parts if p is not None])


def _load(path: Path, rows: int) -> torch.Tensor:
    """The cache file, memory-mapped (every rank shares the page cache), checked."""
    try:
        os.close(_files.open_regular(path, follow=False)[0])  # no link/FIFO planted there
        emb = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except _files.NotRegular as exc:
        raise ConfigError(f"teacher cache {path} {exc}") from None
    except Exception as exc:  # a truncated or foreign file: torch/zipfile errors vary
        raise ConfigError(
            f"teacher cache {path} is unreadable ({type(exc).__name__}); "
            "allowed: a cache this recipe wrote; delete it to rebuild"
        ) from None
    if (
        not isinstance(emb, torch.Tensor)
        or emb.dim() != 2
        or emb.shape[0] < rows
        or not emb.is_floating_point()
    ):
        shape = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
        raise ConfigError(
            f"teacher cache {path} holds {shape}; allowed: a float matrix of "
            f"at least {rows} rows; delete it to rebuild"
        )
    emb = emb[:rows]
    if not bool(torch.isfinite(emb).all()):
        raise ConfigError(
            f"teacher cache {path} holds nan/inf; the teacher overflowed "
            "(try --teacher_dtype float32) or the file is damaged"
        )
    return emb
