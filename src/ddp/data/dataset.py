"""A torch ``Dataset`` over a token store: fixed-length samples, memory flat in the
number of sequences."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp.data.store import IndexArray, TokenStore
from ddp.errors import ConfigError


class TokenDataset(Dataset):
    """Sequence ``indices[i]`` of a store, cropped to ``max_len`` and right-padded with ``pad``.

    Cropping and padding happen per item, so nothing dense is built up front; the
    store and the index array are files read at known offsets (``pread``), and only
    the first ``max_len`` tokens of a sequence are read. The object pickles as paths,
    so DataLoader workers started with ``spawn`` do not copy the data either.
    """

    def __init__(
        self,
        store: TokenStore,
        max_len: int,
        pad: int = 0,
        indices: IndexArray | np.ndarray | None = None,
    ) -> None:
        self.store = store
        self.max_len = max_len
        self.pad = pad
        self.indices = indices

    def __len__(self) -> int:
        return len(self.store) if self.indices is None else len(self.indices)

    def __getitem__(self, i: int) -> torch.Tensor:
        j = int(self.indices[i]) if self.indices is not None else int(i)
        if not 0 <= j < self.store.n_seqs:  # a damaged or foreign split cache
            where = getattr(self.indices, "path", "the index array")
            raise ConfigError(
                f"{str(where)!r}: damaged split cache (entry {i} is sequence "
                f"{j} of a store of {len(self.store)}); delete it"
            )
        seq = self.store.read(j, self.max_len)
        out = np.full(self.max_len, self.pad, dtype=np.int64)
        out[: len(seq)] = seq
        return torch.from_numpy(out)
