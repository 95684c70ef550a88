"""setup.cfg lists its packages by hand: a package folder missing from that list is left
out of a wheel (``pip install hpc-ddp`` without ``-e``), while the editable install the
tests use still finds it through ``src``. ``ddp.checkpoint`` was left out that way."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_in_setup_cfg() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = {p.strip() for p in cfg["options"]["packages"].split() if p.strip()}
    found = {
        ".".join(init.parent.relative_to(base).parts)
        for base, top in ((ROOT, "hpc"), (ROOT / "src", "ddp"), (ROOT / "src", "hpc_ddp"))
        for init in (base / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found, "no packages found"
    assert found - listed == set(), f"not in setup.cfg's packages: {sorted(found - listed)}"
