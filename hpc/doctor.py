"""What this machine has: python, torch and its devices and backends, schedulers,
launchers, optional packages. Torch is asked in a subprocess (the compute side's own
probe, ``python -m ddp.probe``) so that ``hpc`` itself never imports it; optional
packages are found without importing them.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import shutil
import subprocess
import sys
from typing import TypedDict, cast

EXECUTABLES = ("qsub", "sbatch", "srun", "mpiexec", "torchrun")
OPTIONAL = (
    "intel_extension_for_pytorch",
    "oneccl_bindings_for_pytorch",
    "mpi4py",
    "wandb",
    "tensorboard",
    "submitit",
)
#: The compute side's capability probe (``src/ddp/probe.py``), run with the interpreter
#: being checked: one line of JSON, so ``hpc`` never imports torch and carries no copy.
PROBE_MODULE = "ddp.probe"


class TorchInfo(TypedDict, total=False):
    """What ``python -m ddp.probe`` prints: ``error`` alone, or the other three."""

    error: str
    version: str
    devices: dict[str, int]
    backends: dict[str, bool]


def torch_info(timeout: float = 120.0) -> TorchInfo:
    """Torch version, devices and collective backends, from a child interpreter running
    ``python -m ddp.probe`` (the compute side's probe)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", PROBE_MODULE], capture_output=True, text=True, timeout=timeout
        )
        lines = proc.stdout.strip().splitlines()
        if not lines:  # ddp itself not importable there: its own last line says why
            error = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            return {"error": f"probe failed: python -m {PROBE_MODULE}: {error}"}
        return cast(TorchInfo, json.loads(lines[-1]))
    except (subprocess.TimeoutExpired, ValueError, OSError) as exc:
        return {"error": f"probe failed: {exc}"}


def rows(probe_torch: bool = True) -> list[tuple[str, str, bool, str]]:
    """(section, item, found, detail) for every check."""
    out: list[tuple[str, str, bool, str]] = [
        ("python", "python", True, f"{platform.python_version()} ({sys.executable})"),
    ]
    if probe_torch:
        info = torch_info()
        if "error" in info:
            out.append(("torch", "torch", False, str(info["error"])))
        else:
            out.append(("torch", "torch", True, str(info["version"])))
            devices = info.get("devices") or {}
            out.append(
                ("torch", "devices", True, ", ".join(f"{k}:{v}" for k, v in devices.items()))
            )
            for name, ok in (info.get("backends") or {}).items():
                out.append(("backend", name, bool(ok), "available" if ok else "not built in"))
    for exe in EXECUTABLES:
        path = shutil.which(exe)
        out.append(("executable", exe, path is not None, path or "not on PATH"))
    for mod in OPTIONAL:
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        where = spec.origin if spec is not None and spec.origin else "not installed"
        out.append(("package", mod, spec is not None, where))
    return out
