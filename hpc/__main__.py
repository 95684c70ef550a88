"""``python -m hpc``: the same as the ``hpc`` console script."""

from __future__ import annotations

import sys

from hpc.cli import main

if __name__ == "__main__":
    sys.exit(main())
