"""Skip-or-fail policy for tests that need real parts (MPI, SLURM, namespaces).

On a laptop a missing part skips the test with the reason; under ``CI=true``
(where .ci/run installs everything) the same absence fails the run, so a skipped
test is never counted as passing in CI.
"""

from __future__ import annotations

import importlib
import os
import shutil
from typing import Any

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, reason: str) -> None:
    """Skip with ``reason`` when ``condition`` is false; under CI fail instead."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required test part missing under CI: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)  # also from a module body


def require_exe(*names: str) -> str:
    """Return the path of the first of ``names`` found on PATH, else skip (fail in CI)."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    require(False, f"none of {', '.join(names)} found on PATH")
    raise AssertionError("unreachable")


def require_module(name: str, reason: str = "") -> Any:
    """Import ``name`` and return it; where it is missing, skip on a laptop but fail under
    CI (the `test` extra installs every optional library a test uses, so a skip there
    would count an untested recipe as passing, which ``pytest.importorskip`` does)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require(False, f"{name} is not importable ({exc}){'; ' + reason if reason else ''}")
        raise AssertionError("unreachable") from None
