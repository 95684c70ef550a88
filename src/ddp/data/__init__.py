"""ddp.data: token stores on disk and the FASTA preparation that makes them.

* :mod:`ddp.data.store`: the store format and :class:`TokenStore` (a store opened and
  checked); :mod:`ddp.data.store_write`: :class:`StoreWriter` (atomic, from any iterable
  of token sequences via :func:`write_store`);
* :mod:`ddp.data.dataset`: :class:`TokenDataset`, fixed-length samples over a store;
* :mod:`ddp.data.fasta`: streamed, vectorised FASTA -> store;
* ``python -m ddp.data prepare-fasta IN.fasta[.gz] [--out DIR]``: the same from a shell
  (a login node before the job).

Only numpy is needed to write or read a store; :class:`TokenDataset` needs torch.
"""

from __future__ import annotations

from ddp.data.store import TokenStore, is_store
from ddp.data.store_write import StoreWriter, write_store

__all__ = ["StoreWriter", "TokenStore", "is_store", "write_store"]
