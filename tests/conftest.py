"""Shared fixtures. The skip-or-fail policy for real parts lives in tests/support/parts.py;
the real SLURM, PALS and network-namespace fixtures in tests/support/fixtures.py."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.support.fixtures"]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def python_exe() -> str:
    return sys.executable


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture(autouse=True)
def _ddp_log_reaches_caplog() -> Iterator[None]:
    """``ddp.init`` in an earlier in-process test gives the ``ddp`` logger its own stdout
    handler and stops it propagating (``ddp.dist.setup_logging``); caplog listens at the
    root logger, so every later test's ``caplog.text`` would miss ddp's records and pass
    or fail by test order. Each test starts with the logger propagating again."""
    logger = logging.getLogger("ddp")
    before = logger.propagate
    logger.propagate = True
    yield
    logger.propagate = before
