"""The dpo recipe's data: the seed's JSON preference pairs (a ``structure`` record's chain
parsed by Biopython into its prompt), their token rows, and the collate that pads them into
one batch of chosen then rejected rows.

Split from :mod:`ddp.recipes.dpo` (the recipe: model, loss, ``build``), which re-exports
these names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from ddp.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_JSON = 1 << 30  # a pairs file larger than 1 GiB is a mistake, not a dataset
MAX_STRUCTURE = 256 << 20


# ---- data -----------------------------------------------------------------------------------
def load_pairs(path: str | Path, key: str) -> list[dict[str, str]]:
    """The seed's JSON pairs; a ``structure`` record gets its chain's sequence as prompt."""
    from hpc_ddp import files as _files

    try:
        text = _files.read_regular(path, MAX_JSON)[0]
        pairs = json.loads(text)
    except ValueError as exc:  # NotRegular and JSONDecodeError are ValueErrors
        what = f"is not valid JSON: {exc}" if isinstance(exc, json.JSONDecodeError) else exc
        raise ConfigError(f"{key}: {str(path)!r} {what}") from None
    if not isinstance(pairs, list) or not pairs:
        raise ConfigError(
            f"{key}: {str(path)!r} must be a non-empty JSON list of prompt/chosen/rejected objects"
        )
    structures: dict[tuple[str, str], str] = {}
    out = []
    for i, p in enumerate(pairs):
        where = f"{key}: {str(path)!r} record {i}"
        if not isinstance(p, dict):
            raise ConfigError(f"{where} is not an object; allowed: prompt/chosen/rejected")
        if "structure" in p and "prompt" not in p:
            chain = p.get("chain", "")
            if not isinstance(p["structure"], str) or not isinstance(chain, str):
                raise ConfigError(f"{where}: structure and chain must be strings")
            f = (Path(path).parent / p["structure"]).resolve()
            if (str(f), chain) not in structures:
                structures[(str(f), chain)] = structure_sequence(f, chain, where)
            p = {**p, "prompt": structures[(str(f), chain)]}
        for k in ("prompt", "chosen", "rejected"):
            if not isinstance(p.get(k), str):
                raise ConfigError(
                    f"{where} has no string {k!r}; allowed: prompt (or "
                    "structure), chosen and rejected strings"
                )
        if not p["chosen"] or not p["rejected"]:
            raise ConfigError(f"{where} has an empty chosen or rejected response")
        out.append({k: p[k] for k in ("prompt", "chosen", "rejected")})
    return out


def structure_sequence(path: Path, chain: str, where: str) -> str:
    """One-letter sequence of a chain (first model; standard residues, hetero groups and
    waters left out) of a PDB or mmCIF file, parsed by Biopython's ``Bio.PDB``."""
    import io

    from hpc_ddp import files as _files

    try:
        from Bio.PDB import MMCIFParser, PDBParser
        from Bio.PDB.Polypeptide import is_aa
        from Bio.SeqUtils import seq1
    except ImportError:
        from ddp.recipes.dpo import EXTRA

        raise ConfigError(
            f"{where} names a structure file; reading it needs biopython: {EXTRA}"
        ) from None
    try:
        text = _files.read_regular(path, MAX_STRUCTURE)[0].decode("utf-8", "replace")
    except ValueError as exc:
        raise ConfigError(f"{where}: structure {str(path)!r} {exc}") from None
    cif = path.suffix.lower() in (".cif", ".mmcif")
    parser = MMCIFParser(QUIET=True) if cif else PDBParser(QUIET=True)
    try:
        structure = parser.get_structure(path.stem, io.StringIO(text))
        models = list(structure)
    except Exception as exc:  # Biopython's errors on a damaged or crafted file
        raise ConfigError(
            f"{where}: structure {str(path)!r} cannot be parsed as "
            f"{'mmCIF' if cif else 'PDB'} ({type(exc).__name__}: "
            f"{str(exc)[:120]})"
        ) from None
    chains = {c.id: c for c in models[0]} if models else {}
    if not chains:
        raise ConfigError(f"{where}: structure {str(path)!r} holds no chain")
    if chain and chain not in chains:
        raise ConfigError(
            f"{where}: structure {str(path)!r} has no chain {chain!r}; "
            f"allowed: {', '.join(sorted(chains))}"
        )
    residues = chains[chain or next(iter(chains))]
    seq = "".join(
        seq1(r.get_resname()) for r in residues if r.id[0] == " " and is_aa(r, standard=True)
    )
    if not seq:
        raise ConfigError(
            f"{where}: chain {residues.id!r} of {str(path)!r} has no standard amino acid"
        )
    return seq


class PairDataset(Dataset):
    """Token ids of ``prompt + response + EOS`` for chosen and rejected, and where the
    response starts (everything before it, the prompt, is masked out of the loss)."""

    def __init__(
        self,
        pairs: list[dict[str, str]],
        tokenizer: PreTrainedTokenizerBase,
        max_len: int,
        key: str,
    ) -> None:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.items: list[tuple[list[int], int, list[int], int]] = []
        self.ref: torch.Tensor | None = None  # (N, 2) reference log-probs when precomputed
        for i, p in enumerate(pairs):
            prompt = tokenizer(p["prompt"])["input_ids"]
            row: list[Any] = []
            for side in ("chosen", "rejected"):
                ids = (prompt + tokenizer(p[side], add_special_tokens=False)["input_ids"] + eos)[
                    :max_len
                ]
                if len(ids) <= max(1, len(prompt)):
                    raise ConfigError(
                        f"{key}: record {i}'s {side} response has no token "
                        f"within model.max_len={max_len} (prompt: "
                        f"{len(prompt)} tokens); allowed: a larger max_len"
                    )
                row += [ids, max(1, len(prompt))]
            self.items.append(tuple(row))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        c, cs, r, rs = self.items[i]
        out: dict[str, Any] = {"chosen": c, "chosen_start": cs, "rejected": r, "rejected_start": rs}
        if self.ref is not None:
            out["ref"] = self.ref[i]
        return out

    def tokens(self) -> int:
        """Tokens one pass over the data feeds the policy (both sides, no padding)."""
        return sum(len(c) + len(r) for c, _, r, _ in self.items)


def make_collate(pad_id: int) -> Any:
    """Pad a list of pairs to one (2B, L) batch: B chosen rows, then B rejected rows."""

    def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [it["chosen"] for it in items] + [it["rejected"] for it in items]
        starts = [it["chosen_start"] for it in items] + [it["rejected_start"] for it in items]
        n, width = len(rows), max(len(r) for r in rows)
        ids = torch.full((n, width), pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        loss = torch.zeros((n, width), dtype=torch.bool)
        for j, (r, s) in enumerate(zip(rows, starts, strict=True)):
            ids[j, : len(r)] = torch.tensor(r)
            attn[j, : len(r)] = 1
            loss[j, s : len(r)] = True
        batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}
        if "ref" in items[0]:
            batch["ref_logps"] = torch.stack([it["ref"] for it in items])
        return batch

    return collate
