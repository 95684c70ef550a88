"""ddp.data: token stores on disk and the FASTA preparation that makes them.

* :mod:`ddp.data.store`: the store format, :class:`StoreWriter` (atomic, from any
  iterable of token sequences via :func:`write_store`) and :class:`TokenStore`;
* :mod:`ddp.data.dataset`: :class:`TokenDataset`, fixed-length samples over a store;
* :mod:`ddp.data.fasta`: streamed, vectorised FASTA -> store;
* ``python -m ddp.data prepare-fasta IN.fasta[.gz] [--out DIR]``: the same from a shell
  (a login node before the job).

Only numpy is needed to write or read a store; :class:`TokenDataset` needs torch.
"""

from __future__ import annotations

from ddp.data.store import StoreWriter, TokenStore, is_store, write_store

__all__ = ["StoreWriter", "TokenStore", "is_store", "write_store"]
