"""A torch ``Dataset`` over a token store: fixed-length samples, memory flat in the
number of sequences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp.data.store import TokenStore


class TokenDataset(Dataset):
    """Sequence ``indices[i]`` of a store, cropped to ``max_len`` and right-padded with ``pad``.

    Cropping and padding happen per item, so nothing dense is built up front; the
    store and the index array are memory maps. The object pickles as its path (the
    maps are reopened in the receiving process), so DataLoader workers started with
    ``spawn`` do not copy the data either.
    """

    def __init__(self, store: TokenStore, max_len: int, pad: int = 0,
                 indices: np.ndarray | None = None) -> None:  # fmt: skip
        self.store = store
        self.max_len = max_len
        self.pad = pad
        self.indices = indices

    def __len__(self) -> int:
        return len(self.store) if self.indices is None else len(self.indices)

    def __getitem__(self, i: int) -> torch.Tensor:
        j = int(self.indices[i]) if self.indices is not None else int(i)
        seq = self.store[j][: self.max_len]
        out = np.full(self.max_len, self.pad, dtype=np.int64)
        out[: len(seq)] = seq
        return torch.from_numpy(out)

    def __getstate__(self) -> dict[str, Any]:
        idx = self.indices
        state = dict(self.__dict__)
        state["store"] = (str(self.store.path), self.store.tokenizer)
        if isinstance(idx, np.memmap) and idx.filename:
            state["indices"] = (idx.filename, idx.dtype.str)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        path, tok = state["store"]
        state["store"] = TokenStore(Path(path), tok)
        if isinstance(state["indices"], tuple):
            fname, dt = state["indices"]
            state["indices"] = np.memmap(fname, dtype=np.dtype(dt), mode="r")
        self.__dict__.update(state)
