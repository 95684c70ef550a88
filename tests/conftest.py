"""Shared fixtures. The skip-or-fail policy for real parts lives in tests/support/parts.py;
the real SLURM, PALS and network-namespace fixtures in tests/support/fixtures.py."""

from __future__ import annotations

import sys
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
