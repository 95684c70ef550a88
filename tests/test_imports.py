"""Import costs: ``import hpc`` never pulls torch or submitit; ``import ddp`` adds little."""

from __future__ import annotations

import subprocess
import sys

from tests.ddp.launch_utils import clean_env


def _modules_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


def test_import_hpc_is_light():
    mods = _modules_after("import hpc")
    assert "torch" not in mods and "submitit" not in mods and "ddp" not in mods


def test_import_ddp_does_not_import_torch_until_needed():
    mods = _modules_after("import ddp, ddp.env, ddp.exec")
    assert "torch" not in mods and "hpc" not in mods


def test_ddp_never_imports_hpc():
    mods = _modules_after("import ddp, ddp.dist, ddp.backends; ddp.detect()")
    assert not any(m == "hpc" or m.startswith("hpc.") for m in mods)
