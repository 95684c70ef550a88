#!/usr/bin/env python3
"""Generate the small synthetic data shipped in src/ddp/recipes/data/ (fixed seed).

* ``uniref50_tiny.fasta``: protein-like sequences over the 20 amino acids with
  learnable structure: a sparse first-order Markov background plus a handful of
  recurring motifs, so a masked-diffusion LM's loss falls well below ln(20).
* ``dpo_pairs.json``: prompt/chosen/rejected triples; the chosen response is the
  prompt reversed (a rule a tiny LM can learn), the rejected one is random.

Re-running with the same arguments reproduces the files byte for byte.
Usage: python scripts/make_fasta.py [--out DIR] [--seed 0] [--n 400] [--pairs 320]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=400, help="FASTA sequences")
    ap.add_argument("--pairs", type=int, default=320, help="DPO pairs")
    args = ap.parse_args()
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
