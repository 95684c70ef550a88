"""What this machine has: python, torch and its devices and backends, schedulers,
launchers, optional packages. Torch is asked in a subprocess so that ``hpc`` itself
never imports it; optional packages are found without importing them.
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
_TORCH_PROBE = r"""
import json
out = {}
try:
    import torch
    import torch.distributed as dist
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"})); raise SystemExit(0)
out["version"] = torch.__version__
dev = {"cpu": 1}
if torch.cuda.is_available():
    dev["cuda"] = torch.cuda.device_count()
if hasattr(torch, "xpu") and torch.xpu.is_available():
    dev["xpu"] = torch.xpu.device_count()
mps = getattr(torch.backends, "mps", None)
if mps is not None and mps.is_available():
    dev["mps"] = 1
out["devices"] = dev
be = {}
for name in ("gloo", "nccl", "mpi", "xccl", "ucc"):
    fn = getattr(dist, f"is_{name}_available", None)
    if fn is not None:
        try:
            be[name] = bool(fn())
        except Exception:
            be[name] = False
out["backends"] = be
print(json.dumps(out))
"""


class TorchInfo(TypedDict, total=False):
    """What ``_TORCH_PROBE`` prints: ``error`` alone, or the other three."""

    error: str
    version: str
    devices: dict[str, int]
    backends: dict[str, bool]


def torch_info(timeout: float = 120.0) -> TorchInfo:
    """Torch version, devices and collective backends, from a child interpreter."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=timeout
        )
        return cast(TorchInfo, json.loads(proc.stdout.strip().splitlines()[-1]))
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as exc:
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
