"""scripts/test_durations.py reads serial and pytest-xdist (``--dist loadgroup``) logs alike:
the ``slow`` marker in tests/conftest.py looks tests up by their plain node id."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(out: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location(
        "test_durations", ROOT / "scripts/test_durations.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", out)
    return module


def test_xdist_groups_and_parameters_are_left_out_of_the_node_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "log"
    log.write_text(
        "=== slowest durations ===\n"
        "2.50s call     tests/test_e2e_pbs.py::test_plain@pbs\n"
        "0.75s setup    tests/test_e2e_pbs.py::test_plain@pbs\n"
        "1.20s call     tests/x.py::test_p[a-1]@slurm\n"
        "1.30s call     tests/x.py::test_p[b-2]@slurm\n"
        "0.40s call     tests/x.py::test_fast\n"
    )
    out = tmp_path / "durations.json"
    _script(out, monkeypatch).main(str(log))
    assert json.loads(out.read_text()) == {
        "tests/test_e2e_pbs.py::test_plain": 3.25,
        "tests/x.py::test_p": 2.5,
    }


def test_a_log_without_durations_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "log"
    log.write_text("2 passed\n")
    with pytest.raises(SystemExit, match="no --durations=0 lines"):
        _script(tmp_path / "durations.json", monkeypatch).main(str(log))
