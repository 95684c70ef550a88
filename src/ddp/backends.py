"""Which device does this rank own, and which collective backend carries its tensors?

Device ``auto`` picks cuda, then xpu, then mps, then cpu. Backend ``auto`` follows
the device: cuda -> nccl, xpu -> xccl (built into torch >= 2.8) or, on older
builds, ``ccl`` from oneccl_bindings_for_pytorch, mps/cpu -> gloo. The optional
Intel packages are imported only when an XPU path asks for them, so a laptop
never pays for them.

Each local rank gets its own device index (``local_rank % device_count``); when
the launcher masked the other devices (CUDA_VISIBLE_DEVICES / ZE_AFFINITY_MASK
naming one device) the index is 0.

Several processes on one Apple GPU (MPS): Gloo cannot carry MPS tensors and a Mac
has one GPU, so with world size > 1 and device ``auto`` we fall back to the CPU
with one warning (local rank 0) that DDP gives no parallelism there, as seed 002
says, and the job still runs; an explicit ``device="mps"`` with world > 1
stops early with a clear message instead of failing inside the first all-reduce.

NCCL absent (seed 002: "Windows uses the Gloo backend automatically"): torch's Windows
wheels and some CUDA builds have no NCCL (``torch.distributed.is_nccl_available()``
False). Backend ``auto`` on a CUDA device then picks Gloo, which carries CUDA tensors
(slower: through host memory), and says so once (an INFO line, which only rank 0
prints). An explicit ``nccl`` there stays one error line listing what is available.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddp.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ddp")

DEVICES = ("auto", "cuda", "xpu", "mps", "cpu")
BACKENDS = ("auto", "nccl", "gloo", "xccl", "ccl", "mpi", "xpu")


@dataclass(frozen=True)
class Choice:
    """The resolved device and collective backend for one rank."""

    device: torch.device
    backend: str


def _torch():
    import torch

    return torch


def _try_import(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:
        return False
    return True


def xpu_available() -> bool:
    torch = _torch()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    # Old XPU builds register the device only once IPEX is imported.
    if _try_import("intel_extension_for_pytorch"):
        xpu = getattr(torch, "xpu", None)
        return bool(xpu is not None and xpu.is_available())
    return False


def mps_available() -> bool:
    backend = getattr(_torch().backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def available_devices() -> list[str]:
    """Device types usable in this process, best first."""
    torch = _torch()
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if xpu_available():
        found.append("xpu")
    if mps_available():
        found.append("mps")
    found.append("cpu")
    return found


def _xccl_builtin() -> bool:
    dist = _torch().distributed
    is_avail = getattr(dist, "is_xccl_available", None)
    return bool(is_avail is not None and is_avail())


def available_backends() -> list[str]:
    """Collective backends this torch build (plus optional bindings) can create."""
    dist = _torch().distributed
    if not dist.is_available():
        return []
    found = []
    if dist.is_nccl_available():
        found.append("nccl")
    if dist.is_gloo_available():
        found.append("gloo")
    if _xccl_builtin():
        found.append("xccl")
    if dist.is_mpi_available():
        found.append("mpi")
    if "ccl" in dist.Backend.backend_list or _try_import("oneccl_bindings_for_pytorch"):
        found.append("ccl")
    return found


def choose_device(device: str, local_rank: int, world_size: int) -> torch.device:
    """Resolve ``device`` (auto|cuda|xpu|mps|cpu or e.g. ``cuda:1``) for this local rank."""
    torch = _torch()
    kind, _, explicit_index = device.partition(":")
    if kind not in DEVICES:
        raise ConfigError(f"device={device!r} is not known; allowed: {', '.join(DEVICES)}")
    avail = available_devices()
    if kind == "auto":
        kind = avail[0]
        if kind == "mps" and world_size > 1:
            if local_rank == 0:  # once per Mac, not once per process
                log.warning(
                    "%d processes on one Mac: DDP gives no parallelism on its single MPS "
                    "GPU (Gloo cannot carry MPS tensors), so the ranks run on the CPU; for "
                    "speed run one process (python -m ddp ...) on mps",
                    world_size,
                )
            kind = "cpu"
    elif kind not in avail:
        raise ConfigError(f"device={device!r} is not available here; available: {', '.join(avail)}")
    elif kind == "mps" and world_size > 1:
        raise ConfigError(
            f"device='mps' with world size {world_size}: Gloo cannot carry MPS tensors and a "
            "Mac has one GPU; allowed: one process on mps, or device=cpu for several ranks"
        )
    if kind in ("cpu", "mps"):
        return torch.device(kind)
    if explicit_index:
        return torch.device(f"{kind}:{int(explicit_index)}")
    count = torch.cuda.device_count() if kind == "cuda" else torch.xpu.device_count()
    return torch.device(kind, local_rank % max(count, 1))


def choose_backend(backend: str, device: torch.device) -> str:
    """Resolve ``backend`` for ``device``; an unavailable request lists what is available."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not known; allowed: {', '.join(BACKENDS)}")
    avail = available_backends()
    if backend == "auto":
        backend = {"cuda": "nccl", "xpu": "xpu"}.get(device.type, "gloo")
        if backend == "nccl" and "nccl" not in avail and "gloo" in avail:
            log.info(
                "NCCL is not available in this torch build (Windows, or CUDA without "
                "NCCL): backend auto uses Gloo on %s",
                device,
            )
            return "gloo"
    if backend == "xpu":
        # xccl ships with torch >= 2.8; oneCCL bindings (ccl) are the end-of-life fallback.
        if "xccl" in avail:
            return "xccl"
        if "ccl" in avail:
            return "ccl"
        raise ConfigError(
            "backend='xpu' needs torch >= 2.8 built with XPU (xccl) or "
            f"oneccl_bindings_for_pytorch (ccl); available: {', '.join(avail) or 'none'}"
        )
    if backend not in avail:
        raise ConfigError(
            f"backend={backend!r} is not available in this torch build; "
            f"available: {', '.join(avail) or 'none'} (backend auto picks one of them)"
        )
    if backend == "ccl":
        _try_import("oneccl_bindings_for_pytorch")  # registers the backend
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"backend='nccl' needs a CUDA device, but this rank uses {device}")
    return backend


def choose(device: str, backend: str, local_rank: int, world_size: int) -> Choice:
    """Device first (the backend follows it), then the backend; both validated."""
    dev = choose_device(device, local_rank, world_size)
    return Choice(dev, choose_backend(backend, dev))
