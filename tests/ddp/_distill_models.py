"""Tiny real SentenceTransformer folders for the distill tests, built locally (no download).

A BERT-like encoder (``BertConfig`` -> ``BertModel.save_pretrained``) with a WordPiece
tokenizer trained here on the corpus' own lines (``tokenizers``), wrapped as a
SentenceTransformer (Transformer + mean Pooling) and saved with ``.save``: the same
folder layout a hub id downloads, so the recipe takes the hub's code path.
"""

from __future__ import annotations

import functools
import os
import random
import tempfile
from pathlib import Path

WORDS = (
    "cat dog bird fish horse cow sheep goat lion tiger red blue green black white "
    "small big fast slow old young river tree house road hill sea sky runs sleeps "
    "eats jumps sings swims near under over with"
).split()


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n)]


def _tokenizer(lines: list[str]):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import PreTrainedTokenizerFast

    # The vocabulary is spelled out, not trained: WordPieceTrainer breaks ties between
    # equally frequent pieces in hash order, so two processes got different token ids, a
    # different untrained student, and the MRL test's margin moved run to run.
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted({w.lower() for line in lines for w in line.split()})
    chars = sorted({c for w in words for c in w})
    pieces = [*specials, *words, *chars, *(f"##{c}" for c in chars)]
    tok = Tokenizer(WordPiece(vocab={p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=32,
    )


def encoder(out: Path, hidden: int, seed: int, lines: list[str], layers: int = 2) -> Path:
    """A SentenceTransformer folder at ``out``: a small BERT + mean pooling."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel

    hf = out.parent / f"{out.name}_hf"
    tok = _tokenizer(lines)
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    BertModel(cfg).save_pretrained(hf)
    tok.save_pretrained(hf)
    tr = Transformer(str(hf), max_seq_length=32)
    SentenceTransformer(modules=[tr, Pooling(hidden, "mean")], device="cpu").save(str(out))
    return out


def build(root: Path) -> dict[str, Path]:
    """Teacher (width 48), student (width 32), a 48-line corpus and 16 held-out pairs."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root.mkdir(parents=True, exist_ok=True)
    train = corpus(48, 1)
    queries, positives = corpus(16, 2), corpus(16, 3)
    (root / "train.txt").write_text("\n".join(train) + "\n")
    import json

    with open(root / "pairs.jsonl", "w") as fh:
        for q, p in zip(queries, positives, strict=True):
            fh.write(json.dumps({"query": q, "positive": p}) + "\n")
    lines = train + queries + positives
    return {
        "teacher": encoder(root / "teacher", 48, 1, lines),
        "student": encoder(root / "student", 32, 2, lines),
        "train": root / "train.txt",
        "pairs": root / "pairs.jsonl",
    }


@functools.cache
def shared() -> dict[str, Path]:
    """One set per test process (the models are read-only for the recipe)."""
    return build(Path(tempfile.mkdtemp(prefix="distill-models-")))
