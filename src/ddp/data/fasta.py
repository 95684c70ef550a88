"""FASTA -> token store, streamed and vectorised.

The file is read in chunks of whole lines (gzip too); each chunk is tokenized with
operations over the whole chunk (``bytes.translate`` with a 256-entry table maps
residues to ids, numpy masks header lines and finds sequence boundaries), never
a Python loop per residue or per sequence, so preparation runs at disk/numpy speed and its memory is a
few chunks whatever the file's size. Sequence ids (the header's first word) are
hashed vectorised too, for the evaluation split rule.

Only the shape of a FASTA file is checked: the first non-blank byte is ``>`` and
sequence lines hold no control or non-ASCII bytes (a binary file is refused with one
line); letters outside the 20 standard amino acids, ``*`` and ``-`` become ``<unk>``.
Lines end with LF, CRLF or a lone CR (classic Mac), in any mix, as Python's
``splitlines`` reads them. A record with no residues (a header followed by another
header) is left out of the store and counted in one note; a file with no residues at
all, a truncated or corrupt ``.gz``, is refused in one line, leaving no store.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ddp.data.store import (
    HEADER,
    MAX_HEADER,
    STORE_MADE_BY,
    TokenStore,
    _mix64,
    cache_dir,
    open_regular,
    read_regular,
)
from ddp.data.store_write import Interrupted, StoreWriteError, StoreWriter
from ddp.errors import ConfigError

#: Name recorded in every store this module writes; a recipe with another tokenizer
#: refuses the store. Bump the suffix when the id assignment changes.
TOKENIZER = "protein-aa20-v1"
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
N_SPECIALS = 5  # <pad> <mask> <bos> <eos> <unk>, as in ddp.recipes._common
UNK = 4
VOCAB_SIZE = N_SPECIALS + len(AMINO_ACIDS)
SKIP, BAD = 254, 255
CHUNK = 8 << 20
#: A longer line is no protein (and would be held whole in memory): refused in one line.
MAX_LINE = 64 << 20
_ID_BYTES = 32  # bytes of an id that enter its hash (UniRef ids are shorter)


def _lut() -> np.ndarray:
    lut = np.full(256, BAD, dtype=np.uint8)
    lut[0x20:0x7F] = UNK  # printable ASCII that is no residue: <unk>
    for i, a in enumerate(AMINO_ACIDS):
        lut[ord(a)] = lut[ord(a.lower())] = N_SPECIALS + i
    for c in b" \t\r\n\x0b\x0c":
        lut[c] = SKIP
    return lut


LUT = _lut()
MARK = 253  # ">": no residue
_TABLE = bytes(np.where(np.arange(256) == 62, MARK, LUT).astype(np.uint8).tolist())
_ID_COLS = np.arange(1, _ID_BYTES + 1)


def open_bytes(path: Path) -> tuple[BinaryIO, BinaryIO]:
    """(stream of the FASTA's bytes, the raw file for progress); gzip by its magic.

    A regular file only (:func:`~ddp.data.store.open_regular`: a named pipe or a
    symlink loop is one line, never a wait)."""
    raw = os.fdopen(open_regular(path, "a FASTA file or a token store directory"), "rb")
    try:
        magic = raw.read(2)
        raw.seek(0)
    except OSError as exc:
        raw.close()
        raise ConfigError(f"{str(path)!r}: cannot read it ({exc.strerror})") from None
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw  # type: ignore[return-value]
    return raw, raw


def read_block(stream: BinaryIO, raw: BinaryIO, n: int, where: str) -> bytes:
    """Up to ``n`` bytes of the FASTA; a bad ``.gz`` (cut short, a failed CRC, trailing
    bytes that are no gzip member) or a read error is one line."""
    try:
        return stream.read(n)
    except (OSError, EOFError, zlib.error) as exc:
        done = f"after {raw.tell():,} of {os.fstat(raw.fileno()).st_size:,} bytes"
        if stream is not raw:
            raise ConfigError(
                f"{where!r}: truncated or corrupt gzip ({exc}) {done}; expected "
                "a complete .gz FASTA file"
            ) from None
        raise ConfigError(f"{where!r}: cannot read it ({exc}) {done}") from None


def check_fasta(path: str | Path) -> None:
    """Raise a one-line ConfigError unless ``path`` looks like a (gzipped) FASTA file."""
    p = Path(path)
    where = str(p)
    stream, raw = open_bytes(p)
    try:
        if os.fstat(raw.fileno()).st_size == 0:
            raise ConfigError(f"{where!r} is empty; expected a FASTA file")
        head = read_block(stream, raw, 4096, where)
    finally:
        stream.close()
        raw.close()
    _check_head(head, where)


def _check_head(head: bytes, where: str) -> None:
    text = head.lstrip()
    if not text:
        raise ConfigError(f"{where!r} holds only blank space; expected a FASTA file")
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise ConfigError(
            f"{where!r} is a pickle/zip file (torch.save?), not "
            "FASTA; expected a FASTA file ('>' header lines) or a token store "
            "made by python -m ddp.data prepare-fasta"
        )
    if any(b < 9 or 13 < b < 32 for b in head[:1024]):
        raise ConfigError(
            f"{where!r} holds binary data; expected a FASTA text file or a token store directory"
        )
    if not text.startswith(b">"):
        raise ConfigError(
            f"{where!r} starts with {text[:20]!r}, not a FASTA '>' header; "
            "expected a FASTA file or a token store directory"
        )


def _hash_ids(a: np.ndarray, hs: np.ndarray) -> np.ndarray:
    """uint32 hash of each header's id: the bytes after ``>`` up to the first blank or
    control byte (at most 32), all headers at once: a (headers x 32) window gathered
    from the chunk, bytes past the id zeroed, its four 64-bit words mixed."""
    if not len(hs):
        return np.zeros(0, np.uint32)
    w = a[np.minimum(hs[:, None] + _ID_COLS, len(a) - 1)]
    ends = w <= 32  # space, tab, CR, LF and control bytes end an id
    ends[:, -1] = True
    length = np.argmax(ends, axis=1)
    w[_ID_COLS[None, :] - 1 >= length[:, None]] = 0
    words = np.ascontiguousarray(w).view(np.uint64)
    h = length.astype(np.uint64)
    with np.errstate(over="ignore"):
        for k in range(words.shape[1]):  # a polynomial over the words, mixed once
            h = h * np.uint64(0x100000001B3) + words[:, k]
    return _mix64(h).astype(np.uint32)


def _tokenize_chunk(
    buf: bytes, where: str, base: int
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """One chunk of whole lines -> (tokens, residues before its first header, residues
    of each sequence started in it, id hash of each such sequence).

    ``bytes.translate`` maps every byte to its token id or to a marker (blank, ``>``,
    a byte no FASTA text holds); a per-byte "sequence line" mask is ``np.repeat`` of a
    per-line flag; a sequence's length is its span minus the non-token bytes in it,
    found by binary search over those (few) positions.
    """
    a = np.frombuffer(buf, dtype=np.uint8)
    nl = np.flatnonzero(a == 10)
    starts = np.empty_like(nl)
    starts[:1] = 0
    starts[1:] = nl[:-1] + 1
    hdr = a[starts] == 62  # '>'
    hs, he = starts[hdr], nl[hdr]
    in_seq = np.repeat(~hdr, nl - starts + 1)  # the chunk ends with a newline
    code = np.frombuffer(buf.translate(_TABLE), dtype=np.uint8)
    bad = code == BAD
    if bad.any() and (bad & in_seq).any():  # non-ASCII in a header is fine
        off = base + int(np.argmax(bad & in_seq))
        raise ConfigError(
            f"{where!r}: byte {off} is a control or non-ASCII byte "
            "in a sequence line; expected a FASTA text file"
        )
    sel = (code < MARK) & in_seq
    tokens = code[sel]
    seq_lines = ~hdr
    if int((nl - starts + 1)[seq_lines].sum()) - len(tokens) == int(seq_lines.sum()):
        gaps = nl[seq_lines]  # the common case: the only non-residue bytes are newlines
    else:
        gaps = np.flatnonzero(in_seq & ~sel)  # also CRs, blanks inside sequence lines
    hashes = _hash_ids(a, hs)
    if not len(hs):
        return tokens, len(tokens), np.zeros(0, np.int64), hashes
    seg_start = he + 1
    seg_end = np.append(hs[1:], len(a))
    lengths = (seg_end - seg_start) - (
        np.searchsorted(gaps, seg_end) - np.searchsorted(gaps, seg_start)
    )
    lead = int(hs[0]) - int(np.searchsorted(gaps, hs[0]))
    return tokens, lead, lengths.astype(np.int64), hashes


log = logging.getLogger("ddp")

Progress = Callable[[int, int], None]


def _whole_lines(stream: BinaryIO, raw: BinaryIO, where: str) -> Iterator[tuple[bytes, int]]:
    """The file in chunks of whole lines, each with its byte offset: a chunk ends at its
    last newline and the rest carries over, so no record's line is split between two
    tokenizer calls. CR and CRLF ends become newlines; a last line without one gets one;
    a line longer than ``MAX_LINE`` is one line of error (a binary or non-FASTA file
    would otherwise be read whole into memory)."""
    carry = b""
    base = 0
    while True:
        block = read_block(stream, raw, CHUNK, where)
        if b"\r" in block:  # CR and CRLF line ends: a CR is a newline, CRLF a blank line more
            block = block.replace(b"\r", b"\n")
        buf = carry + block if carry else block
        if not block:
            if not buf:
                return
            if not buf.endswith(b"\n"):
                buf += b"\n"
            cut = len(buf)
        else:
            cut = buf.rfind(b"\n") + 1
            if cut == 0:  # one line longer than a chunk: read on, up to a bound
                if len(buf) > MAX_LINE:
                    raise ConfigError(
                        f"{where!r}: the line at byte {base:,} is longer "
                        f"than {MAX_LINE:,} bytes; expected a FASTA file of "
                        "proteins (the longest known is ~35,000 residues)"
                    )
                carry = buf
                continue
        carry = buf[cut:]
        yield buf[:cut], base
        base += cut
        if not block:
            return


def prepare_fasta(
    path: str | Path,
    out: str | Path,
    progress: Progress | None = None,
    force: bool = False,
    note: Callable[[str], None] | None = None,
) -> TokenStore:
    """Tokenize a FASTA file into a token store at ``out`` (atomically); returns it.

    ``progress(bytes_read, total_bytes)`` is called after every chunk (bytes of the
    file on disk, compressed for gzip). ``note`` (default: a log warning) gets one line
    when empty records were left out. ``force`` replaces a store ddp.data wrote, never
    anything else, never the input.
    """
    p = Path(path)
    where = str(p)
    check_fasta(p)
    writer = StoreWriter(
        out, TOKENIZER, VOCAB_SIZE, source=os.path.realpath(p), overwrite=force, inputs=(p,)
    )
    stream, raw = open_bytes(p)
    st = os.fstat(raw.fileno())
    writer.extra.update(source_size=st.st_size, source_mtime_ns=st.st_mtime_ns)
    have_seq = False
    records = skipped = 0

    def close(lengths: np.ndarray, hashes: np.ndarray) -> None:
        nonlocal records, skipped
        keep = lengths > 0
        records += len(lengths)
        skipped += len(lengths) - int(keep.sum())
        writer.end_sequences(lengths[keep], hashes[keep])

    with stream, raw, writer:
        pending = 0
        pending_hash = np.zeros(0, np.uint32)
        for lines, base in _whole_lines(stream, raw, where):
            tokens, lead, lengths, hashes = _tokenize_chunk(lines, where, base)
            if lead and not have_seq:
                raise ConfigError(
                    f"{where!r}: residues before the first '>' header; expected a FASTA file"
                )
            writer.add_tokens(tokens)
            if len(lengths):
                if have_seq:
                    close(np.array([pending + lead]), pending_hash)
                pending = int(lengths[-1])
                pending_hash = hashes[-1:]
                close(lengths[:-1], hashes[:-1])
                have_seq = True
            else:
                pending += lead
            if progress is not None:
                progress(raw.tell(), st.st_size)
        if not have_seq:
            raise ConfigError(f"{where!r} holds no FASTA sequences")
        close(np.array([pending]), pending_hash)
        if not writer.n_tokens:
            raise ConfigError(
                f"{where!r} holds {records:,} FASTA headers but no residues; "
                "expected sequence lines under the '>' headers"
            )
        writer.extra["empty_records_skipped"] = skipped
    if skipped:
        (note or log.warning)(
            f"{where}: skipped {skipped:,} empty "
            f"record{'s' if skipped > 1 else ''} (a '>' header with no "
            f"residues) of {records:,}"
        )
    return TokenStore(out, TOKENIZER, VOCAB_SIZE)


def is_current(store: Path, fasta: Path) -> bool:
    """Whether ``store`` was prepared from ``fasta`` as it is now (size and mtime)."""
    try:
        rec = json.loads(read_regular(store / HEADER, STORE_MADE_BY, MAX_HEADER))
        st = fasta.stat()
    except (ConfigError, OSError, ValueError, RecursionError):
        return False
    return (
        isinstance(rec, dict)
        and rec.get("source_size") == st.st_size
        and rec.get("source_mtime_ns") == st.st_mtime_ns
    )


class PlainProgress:
    """Progress lines for a batch log: at most one every ``every_s`` seconds, plus the end."""

    def __init__(self, emit: Callable[[str], None], every_s: float = 5.0) -> None:
        self.emit, self.every_s = emit, every_s
        self.t0 = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s and done < total:
            return
        self.last = now
        mb = done / 1e6
        rate = mb / max(now - self.t0, 1e-9)
        pct = 100.0 * done / total if total else 100.0
        self.emit(f"prepare: {mb:,.0f}/{total / 1e6:,.0f} MB ({pct:.0f}%) {rate:,.0f} MB/s")


def store_path(fasta: Path, cache: str | Path | None = None) -> Path:
    """The store a FASTA file trains from: beside it (``IN.fasta.tokens``) when its
    directory is writable and no cache is configured, else in the cache directory
    under a name that includes a digest of the FASTA's absolute path."""
    if not cache and os.access(fasta.parent, os.W_OK):
        return fasta.with_name(fasta.name + ".tokens")
    digest = hashlib.sha1(os.path.realpath(fasta).encode()).hexdigest()[:12]
    return Path(cache or cache_dir()) / f"{fasta.name}-{digest}.tokens"


def resolve_store(data: str | Path, cache: str | Path | None = None) -> Path:
    """Collective: the store directory for ``data`` (a store, a FASTA file, or seed 004's
    ``processed_uniref50.pt``, converted as a FASTA is prepared).

    Given a FASTA file, rank 0 prepares its store once if it is missing or older
    than the file (the other ranks wait in a broadcast, which also carries rank 0's
    error, if any, so every rank stops with the same line); a later start finds
    the store and prepares nothing. Anything that is neither a store nor FASTA
    stops with one line naming the file and what was expected.
    """
    import ddp

    p = Path(data)
    if p.is_dir():
        if not (p / HEADER).is_file():
            raise ConfigError(
                f"{str(p)!r} is a directory without {HEADER}; expected a token "
                "store made by python -m ddp.data prepare-fasta, or a FASTA file"
            )
        return p
    out = store_path(p, cache)
    error: str | None = None
    if ddp.is_main_process():
        try:
            if p.suffix != ".pt":  # seed 004's processed_uniref50.pt: ddp.data.processed
                check_fasta(p)
            if not (out / HEADER).is_file() or not is_current(out, p):
                log.info("preparing %s -> %s (once; later runs reuse it)", p, out)
                if p.suffix == ".pt":
                    from ddp.data.processed import prepare_pt

                    prepare_pt(p, out, force=out.exists())
                else:
                    prepare_fasta(p, out, PlainProgress(log.info), force=out.exists())
        except Interrupted as exc:  # the job was stopped while preparing: end by the signal
            log.warning("%s while preparing %s: its partial store was removed", exc, out)
            exc.redeliver()
        except StoreWriteError as exc:
            error = f"{exc}; set recipe.cache_dir or $DDP_DATA_CACHE to another directory"
        except ConfigError as exc:
            error = str(exc)
        except OSError as exc:
            error = (
                f"{str(out)!r}: cannot write the token store ({exc.strerror}); set "
                "recipe.cache_dir or $DDP_DATA_CACHE to a writable directory"
            )
    error = ddp.broadcast_object(error)
    if error:
        raise ConfigError(error)
    return out
