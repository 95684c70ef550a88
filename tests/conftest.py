"""Shared fixtures. The skip-or-fail policy for real parts lives in tests/support/parts.py;
the real SLURM, PALS and network-namespace fixtures in tests/support/fixtures.py."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.support.fixtures"]

ROOT = Path(__file__).resolve().parents[1]

#: A test that uses one of these fixtures needs that real part, so it carries the marker
#: whether or not its module says so (``make test-fast`` deselects them by marker; a new
#: test cannot forget it).
FIXTURE_MARKERS = {
    "slurm_cluster": "slurm",
    "openpbs_server": "pbs",
    "pals_mpiexec": "mpi",
    "netns_pair": "multinode",
}


#: A test that took this long in the last measured full run (tests/durations.json,
#: written by scripts/test_durations.py) is marked ``slow``.
SLOW_S = 1.0


def _measured() -> dict[str, float]:
    path = ROOT / "tests" / "durations.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seconds = _measured()
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in used:
                item.add_marker(marker)
        if seconds.get(item.nodeid.split("[", 1)[0], 0.0) >= SLOW_S:
            item.add_marker("slow")


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
