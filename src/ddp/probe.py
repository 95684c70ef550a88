"""``python -m ddp.probe``: what torch can do in this interpreter, as one line of JSON.

The compute side owns its capability probe: ``hpc doctor`` (login side, which never
imports torch) runs this module with the interpreter it checks and reads the line, so the
probe is written once, here, beside the code that uses those devices and backends. It
imports only torch (never the rest of ``ddp`` beyond its light package import), and
reports a torch that is missing or broken as ``{"error": "..."}`` with exit 0, so the
doctor prints one row instead of a traceback.

Output: ``{"version": "2.x", "devices": {"cpu": 1, "cuda": N, ...}, "backends":
{"gloo": true, "nccl": false, ...}}``.
"""

from __future__ import annotations

import json
from typing import Any

#: Collective backends asked about, by torch.distributed's ``is_<name>_available``.
BACKENDS = ("gloo", "nccl", "mpi", "xccl", "ucc")


def probe() -> dict[str, Any]:
    """Torch's version, device counts and collective backends; ``{"error": ...}`` when
    torch cannot be imported."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # a missing or broken torch is what the doctor reports
        return {"error": f"{type(exc).__name__}: {exc}"}
    devices: dict[str, int] = {"cpu": 1}
    if torch.cuda.is_available():
        devices["cuda"] = torch.cuda.device_count()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        devices["xpu"] = torch.xpu.device_count()
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices["mps"] = 1
    backends: dict[str, bool] = {}
    for name in BACKENDS:
        fn = getattr(dist, f"is_{name}_available", None)
        if fn is not None:
            try:
                backends[name] = bool(fn())
            except Exception:  # a backend whose check itself fails is not available
                backends[name] = False
    return {"version": torch.__version__, "devices": devices, "backends": backends}


def main() -> None:
    print(json.dumps(probe()))


if __name__ == "__main__":
    main()
