"""Helpers for the hpc tests: build jobs without touching the caller's environment."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def make_job(cluster: str, **overrides: Any) -> Any:
    """A resolved Job from flag-style overrides, independent of $PBS_ACCOUNT and friends."""
    from hpc.core import build_job

    spec = overrides.pop("spec", None)
    return build_job(spec, {"cluster": cluster, **overrides}, environ={}, cwd=REPO)


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Put small fake scheduler clients first on PATH: ``fake_bin(name, bash_body)``."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.log"))

    def add(name: str, body: str) -> Path:
        path = bindir / name
        path.write_text(f'#!/bin/bash\necho "{name} $*" >> "$FAKE_LOG"\n{body}\n')
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
        return path

    add.log = tmp_path / "calls.log"  # type: ignore[attr-defined]
    return add
