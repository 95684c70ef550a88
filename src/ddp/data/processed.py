"""Seed 004's ``processed_uniref50.pt`` -> a token store (``--datafile FILE.pt``).

The seed trains from a ``torch.save``d Python object: a list of token tensors, one per
protein (its data script saves a list of records ``{'protein_seq', 'prot_tokens',
'length'}`` with ``prot_tokens`` a 1-D ``long`` tensor padded to 512), or a dict holding
such a list. This module reads that object once and writes the same proteins into a token
store beside the file (``FILE.pt.tokens``, or the cache when the folder is read-only), as
a FASTA file is; training then reads the store, never the pickle.

The ids are the seed's vocabulary, from its data script: ``<s> <pad> </s> <unk> <mask>``
(0-4), then the 20 amino acids ``ACDEFGHIKLMNPQRSTVWY`` (5-24). The residues keep their
ids (``ddp.data.fasta``'s tokenizer puts the same letters at 5-24); ``<unk>`` becomes
ours; ``<s>``, ``<pad>`` and ``</s>`` are dropped (the store keeps bare residues and
pads per batch); a ``<mask>`` in the data, an id outside 0-24 or a negative one is
refused, naming the record: a file tokenized with another vocabulary (ESM's 33 ids)
would otherwise train on the wrong residues without a word.

The file is untrusted input: a regular file only (a FIFO would block), at most
:data:`MAX_BYTES`, loaded with ``torch.load(weights_only=True)`` (no code runs: only
tensors and plain containers), memory-mapped where the format allows so that tensor bytes
are paged in as they are converted. Anything else (another shape, a float or NaN tensor,
an object, a damaged zip) is one line naming the file and what is allowed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ddp.data.fasta import TOKENIZER, UNK, VOCAB_SIZE
from ddp.data.store import TokenStore, open_regular
from ddp.data.store_write import StoreWriter
from ddp.errors import ConfigError

#: The seed's vocabulary, in id order (its data script's ``special_tokens + amino_acids``).
SEED_VOCAB = ("<s>", "<pad>", "</s>", "<unk>", "<mask>", *"ACDEFGHIKLMNPQRSTVWY")
MAX_BYTES = 64 << 30
"""Largest ``.pt`` read. The seed's script writes 4 KiB a protein (512 int64), so this is
~16M proteins; all of UniRef50 is better fetched as FASTA (``download-uniref50``)."""
_BAD, SKIP_ID = 255, 254
_BATCH = 1 << 22  # tokens converted per write

#: seed id -> store id; SKIP_ID drops the token, _BAD refuses the file.
_LUT = np.full(len(SEED_VOCAB), _BAD, dtype=np.uint8)
_LUT[[0, 1, 2]] = SKIP_ID
_LUT[3] = UNK
_LUT[5:] = np.arange(5, 25)


def _expected() -> str:
    return (
        "a list of 1-D integer token tensors (or of records holding one, as seed 004's "
        "{'prot_tokens': ...}), a 2-D integer tensor of rows, or a dict holding one of "
        "these"
    )


def load(path: Path) -> Any:
    """The object in ``path``, loaded with ``weights_only=True`` (one line on failure)."""
    import torch

    where = str(path)
    fd = open_regular(path, "seed 004's processed_uniref50.pt (a torch.save file)")
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size > MAX_BYTES:
        raise ConfigError(
            f"{where!r} is {size:,} bytes, more than {MAX_BYTES:,} "
            f"({MAX_BYTES / 2**30:g} GiB); allowed: a smaller file, or UniRef50 "
            "as FASTA (python -m ddp.data download-uniref50)"
        )
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)  # a legacy file
    except Exception as exc:
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(
            f"{where!r} cannot be loaded with torch.load(weights_only=True) "
            f"({why}); expected {_expected()}"
        ) from None


def records(obj: Any, where: str) -> Any:
    """The sequence of token tensors inside ``obj`` (see :func:`_expected`)."""
    import torch

    if isinstance(obj, dict):
        found = [
            (k, v)
            for k, v in obj.items()
            if isinstance(v, (list, tuple)) or (isinstance(v, torch.Tensor) and v.dim() == 2)
        ]
        if len(found) != 1:
            keys = ", ".join(repr(k)[:40] for k in list(obj)[:8])
            raise ConfigError(
                f"{where!r} holds a dict with {len(found)} lists of sequences "
                f"(keys: {keys}); expected {_expected()}"
            )
        obj = found[0][1]
    if isinstance(obj, torch.Tensor) and obj.dim() == 2:
        return obj
    if not isinstance(obj, (list, tuple)):
        raise ConfigError(f"{where!r} holds {type(obj).__name__}; expected {_expected()}")
    return obj


def _tokens(rec: Any, i: int, where: str) -> np.ndarray:
    """Record ``i`` as int64 ids of the seed's vocabulary, checked."""
    import torch

    if isinstance(rec, dict):
        tensors = [v for v in rec.values() if isinstance(v, torch.Tensor)]
        if len(tensors) != 1:
            raise ConfigError(
                f"{where!r}: record {i} is a dict with {len(tensors)} tensors; "
                f"expected {_expected()}"
            )
        rec = tensors[0]
    if not isinstance(rec, torch.Tensor):
        raise ConfigError(f"{where!r}: record {i} is {type(rec).__name__}; expected {_expected()}")
    if (
        rec.dim() != 1
        or rec.dtype.is_floating_point
        or rec.dtype.is_complex
        or rec.dtype == torch.bool
    ):
        raise ConfigError(
            f"{where!r}: record {i} is a {rec.dim()}-D {rec.dtype} tensor; expected {_expected()}"
        )
    ids = rec.detach().to(torch.int64).numpy()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(SEED_VOCAB)):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ConfigError(
            f"{where!r}: record {i} holds token id {bad}; expected ids 0-"
            f"{len(SEED_VOCAB) - 1} of seed 004's vocabulary (<s> <pad> </s> "
            "<unk> <mask>, then ACDEFGHIKLMNPQRSTVWY); a file tokenized "
            "otherwise: prepare its FASTA instead"
        )
    return ids


def prepare_pt(
    path: str | Path,
    out: str | Path,
    force: bool = False,
    note: Callable[[str], None] | None = None,
) -> TokenStore:
    """Convert the seed's ``.pt`` at ``path`` into a token store at ``out`` (atomically)."""
    p = Path(path)
    where = str(p)
    obj = load(p)
    rows = records(obj, where)
    st = p.stat()
    writer = StoreWriter(
        out,
        TOKENIZER,
        VOCAB_SIZE,
        source=os.path.realpath(p),
        overwrite=force,
        inputs=(p,),
        extra={
            "source_size": st.st_size,
            "source_mtime_ns": st.st_mtime_ns,
            "source_vocab": "seed004: " + " ".join(SEED_VOCAB),
        },
    )
    empty = 0
    with writer:
        flat: list[np.ndarray] = []
        lengths: list[int] = []
        pending = 0
        for i in range(len(rows)):
            mapped = _LUT[_tokens(rows[i], i, where)]
            if (mapped == _BAD).any():
                raise ConfigError(
                    f"{where!r}: record {i} holds <mask> (id 4); expected "
                    "proteins, whose residues are never masked in the data"
                )
            kept = mapped[mapped != SKIP_ID]
            if not len(kept):
                empty += 1
                continue
            flat.append(kept)
            lengths.append(len(kept))
            pending += len(kept)
            if pending >= _BATCH:
                writer.add_flat(np.concatenate(flat), np.array(lengths))
                flat, lengths, pending = [], [], 0
        if flat:
            writer.add_flat(np.concatenate(flat), np.array(lengths))
        if not writer.n_seqs:
            raise ConfigError(
                f"{where!r} holds {len(rows):,} records but no residues; expected {_expected()}"
            )
        writer.extra["empty_records_skipped"] = empty
    if empty:
        msg = f"{where}: skipped {empty:,} record(s) with no residues of {len(rows):,}"
        (note or logging.getLogger("ddp").warning)(msg)
    return TokenStore(out, TOKENIZER, VOCAB_SIZE)
