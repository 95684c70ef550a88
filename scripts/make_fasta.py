#!/usr/bin/env python3
"""Generate the small synthetic data shipped in src/ddp/recipes/data/ (fixed seed).

* ``uniref50_tiny.fasta``: protein-like sequences over the 20 amino acids with
  learnable structure: a sparse first-order Markov background plus a handful of
  recurring motifs, so a masked-diffusion LM's loss falls well below ln(20).
* ``dpo_pairs.json``: prompt/chosen/rejected triples; the chosen response is the
  prompt reversed (a rule a tiny LM can learn), the rejected one is random.

Re-running with the same arguments reproduces the files byte for byte.
Usage: python scripts/make_fasta.py [--out DIR] [--seed 0] [--n 400] [--pairs 320]

With ``--size SIZE --fasta PATH`` it instead streams a synthetic FASTA of about SIZE
bytes (``20M``, ``2G``; ``.gz`` compresses) for tests and benchmarks: the same kind of
Markov + motif sequences, lengths 40-400, wrapped at 60, generated vectorised with
numpy (hundreds of MB/s), so a 2 GB file takes seconds, not hours.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

AA = "ACDEFGHIKLMNPQRSTVWY"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "ddp" / "recipes" / "data"


def markov(rng: random.Random) -> dict[str, list[float]]:
    """Each residue prefers four successors (70% of the mass)."""
    table = {}
    for a in AA:
        fav = rng.sample(AA, 4)
        table[a] = [0.7 / 4 * (b in fav) + 0.3 / 20 for b in AA]
    return table


def sequence(rng: random.Random, table: dict[str, list[float]], motifs: list[str]) -> str:
    n = rng.randint(40, 120)
    out = [rng.choice(AA)]
    while len(out) < n:
        if rng.random() < 0.04:
            out.extend(rng.choice(motifs))
        else:
            out.append(rng.choices(AA, weights=table[out[-1]])[0])
    return "".join(out[:n])


def parse_size(text: str) -> int:
    """``2G`` -> 2_000_000_000 (decimal units, as disk sizes are quoted)."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def big_fasta(path: Path, size: int, seed: int = 0, batch: int = 20000) -> tuple[int, int]:
    """Write about ``size`` bytes of synthetic FASTA to ``path``; (sequences, bytes)."""
    import gzip

    import numpy as np

    rng = np.random.default_rng(seed)
    aa = np.frombuffer(AA.encode(), dtype=np.uint8)
    fav = np.stack([rng.choice(20, 4, replace=False) for _ in range(20)])  # 4 successors each
    motifs = [rng.integers(0, 20, rng.integers(5, 9)) for _ in range(8)]
    opener = gzip.open if path.suffix == ".gz" else open
    written = n = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with opener(path, "wb") as fh:  # type: ignore[operator]
        while written < size:
            lengths = rng.integers(40, 401, batch)
            width = int(lengths.max())
            seq = np.empty((batch, width), dtype=np.int64)
            seq[:, 0] = rng.integers(0, 20, batch)
            for j in range(1, width):  # vectorised over the batch: one step of every chain
                follow = rng.random(batch) < 0.7
                seq[:, j] = np.where(
                    follow,
                    fav[seq[:, j - 1], rng.integers(0, 4, batch)],
                    rng.integers(0, 20, batch),
                )
            for k, m in enumerate(motifs):  # plant each motif in some sequences
                rows = np.flatnonzero(rng.random(batch) < 0.3)
                at = rng.integers(0, 40 - len(m), len(rows)) + 8 * k % 30
                for q, r in enumerate(m):
                    seq[rows, at + q] = r
            letters = aa[seq]
            parts = []
            for i in range(batch):
                s = letters[i, : lengths[i]].tobytes()
                body = b"\n".join(s[j : j + 60] for j in range(0, len(s), 60))
                parts.append(
                    b">UniRef50_SYN%09d Synthetic protein n=1 Tax=Synthetic TaxID=0\n" % (n + i)
                    + body
                    + b"\n"
                )
            blob = b"".join(parts)
            fh.write(blob)
            written += len(blob)
            n += batch
    return n, written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, help="with --fasta: bytes of FASTA (20M, 2G)")
    ap.add_argument("--fasta", type=Path, help="with --size: the FASTA to write (.gz too)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=400, help="FASTA sequences")
    ap.add_argument("--pairs", type=int, default=320, help="DPO pairs")
    args = ap.parse_args()
    if args.size is not None or args.fasta is not None:
        if args.size is None or args.fasta is None:
            ap.error("--size and --fasta go together")
        n, nbytes = big_fasta(args.fasta, args.size, args.seed)
        print(f"wrote {n} sequences, {nbytes / 1e6:.1f} MB to {args.fasta}")
        return
    rng = random.Random(args.seed)
    table = markov(rng)
    motifs = ["".join(rng.choices(AA, k=rng.randint(5, 8))) for _ in range(8)]
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(args.n):
        seq = sequence(rng, table, motifs)
        lines.append(f">UniRef50_SYN{i:05d} Synthetic protein n=1 Tax=Synthetic TaxID=0")
        lines.extend(seq[j : j + 60] for j in range(0, len(seq), 60))
    (args.out / "uniref50_tiny.fasta").write_text("\n".join(lines) + "\n")
    pairs = []
    for _ in range(args.pairs):
        prompt = "".join(rng.choices(AA, k=rng.randint(6, 10)))
        rejected = "".join(rng.choices(AA, k=len(prompt)))
        pairs.append({"prompt": prompt, "chosen": prompt[::-1], "rejected": rejected})
    (args.out / "dpo_pairs.json").write_text(json.dumps(pairs, indent=0) + "\n")
    print(f"wrote {args.n} sequences and {args.pairs} pairs to {args.out}")


if __name__ == "__main__":
    main()
