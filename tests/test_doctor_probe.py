"""``hpc doctor`` asks the compute side's probe (``python -m ddp.probe``) what torch can do,
instead of carrying a copy of it as a program inside a string."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_the_probe_module_reports_this_torch_as_json() -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    out = subprocess.run(
        [sys.executable, "-m", "ddp.probe"], capture_output=True, text=True, check=True
    ).stdout
    info = json.loads(out.strip().splitlines()[-1])
    assert info["version"] == torch.__version__
    assert info["devices"]["cpu"] == 1
    assert info["backends"]["gloo"] is dist.is_gloo_available()


def test_a_torch_that_cannot_be_imported_is_one_error_not_a_traceback() -> None:
    code = (
        "import sys, runpy; sys.modules['torch'] = None; "
        "runpy.run_module('ddp.probe', run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == ""
    assert json.loads(proc.stdout) == {
        "error": "ModuleNotFoundError: import of torch halted; None in sys.modules"
    }


def test_doctor_runs_the_compute_sides_probe_and_carries_no_copy() -> None:
    torch = pytest.importorskip("torch")
    from hpc import doctor

    assert not hasattr(doctor, "_TORCH_PROBE")
    rows = {(section, item): (ok, detail) for section, item, ok, detail in doctor.rows()}
    assert rows[("torch", "torch")] == (True, torch.__version__)
    assert rows[("torch", "devices")][1].startswith("cpu:1")
    assert rows[("backend", "gloo")][0] is torch.distributed.is_gloo_available()


def test_a_probe_that_cannot_run_is_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc import doctor

    monkeypatch.setattr(doctor, "PROBE_MODULE", "ddp.no_such_probe")
    info = doctor.torch_info()
    assert info == {
        "error": "probe failed: python -m ddp.no_such_probe: "
        f"{sys.executable}: No module named ddp.no_such_probe"
    }
