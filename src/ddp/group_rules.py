"""How the process groups meet each accelerator: XCCL's point-to-point fix on torch 2.8,
the default group bound to this rank's device on XPU, and the CPU (Gloo) groups made beside
it unbound and lazily connected.

Split from :mod:`ddp.dist`, which re-exports every name here and calls them from
``init`` and ``checkpoint_group``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


#: pytorch#156782 (https://github.com/pytorch/pytorch/issues/156782): XCCL ``Send``/``Recv``
#: (and gather, scatter, grouped collectives) "may get stuck" on torch 2.8; the workaround
#: is "CCL_SEND=direct and CCL_RECV=direct", fixed in 2.9. Known only on the node (the
#: torch the job imports), so the compute side sets it, before the process group exists.
XCCL_P2P_FIX = {"CCL_SEND": "direct", "CCL_RECV": "direct"}


def xccl_p2p_env(
    device_type: str, torch_version: str, environ: dict[str, str] | os._Environ[str]
) -> dict[str, str]:
    """The variables to set for pytorch#156782: on XPU with torch 2.8.x only, and never
    over a value the user set (``CCL_SEND=...`` in the job wins)."""
    release = torch_version.split("+", 1)[0].split(".")
    if device_type != "xpu" or release[:2] != ["2", "8"]:
        return {}
    return {k: v for k, v in XCCL_P2P_FIX.items() if k not in environ}


#: ezpz PR #149 (https://github.com/saforem2/ezpz/pull/149, Aurora job 8518207): FSDP2 on
#: XPU deadlocked on its first ``all_gather_into_tensor`` until the default group was made
#: with ``init_process_group(device_id=xpu:N)`` after ``torch.xpu.set_device(N)``: unbound,
#: xccl routed some ranks' collectives to ``xpu:0`` and others to ``xpu:LOCAL_RANK``.
#: Bound on every XPU job, not only FSDP2 ones: ``init`` runs before the strategy is known,
#: and torch 2.13's Python side does little else with it on the paths this project takes
#: (distributed_c10d.py: ``init_process_group`` stores it as ``pg.bound_device_id``,
#: 2095-2096; eager connect only for a backend that ``supports_splitting``, 2333-2335;
#: ``barrier`` takes it as its device, 5332-5334; DeviceMesh's ``split_group``, 564, is
#: for a mesh dimension smaller than the world, device_mesh.py 523, and ddp.fsdp's mesh
#: is 1-D over every rank). ``new_group`` inherits it: see :func:`_unbound_default_group`.
#: Device type -> the backends whose default group is bound. Not on nccl: its binding
#: also switches on eager communicators and ``ncclCommSplit`` (a change of its own, not
#: this fix); never on gloo, which has no backend for the accelerator (backend_capability).
BIND_DEVICE_ID: dict[str, tuple[str, ...]] = {"xpu": ("xccl",)}


def bound_device(device: torch.device, backend: str) -> torch.device | None:
    """The ``device_id`` to make the default group with (:data:`BIND_DEVICE_ID`): the
    device this rank was just set to, or None where the rule does not apply."""
    if device.index is None or backend not in BIND_DEVICE_ID.get(device.type, ()):
        return None
    return device


@contextmanager
def _unbound_default_group() -> Iterator[None]:
    """The default group's ``bound_device_id`` (:data:`BIND_DEVICE_ID`) cleared while a
    CPU (Gloo) group is made, then put back.

    torch 2.13's ``new_group`` gives the new group the default group's bound device
    (distributed_c10d.py 5963-5964, ``device_id = default_pg.bound_device_id``); an
    explicit other one is refused ("Mismatched bound device", 5965-5969), and ``cpu`` is
    refused anyway (2014-2017). The Gloo group would then be bound to ``xpu:N`` and
    ``new_group`` fails at its eager-connect check, ``pg._get_backend(device_id)``
    (2333): "No backend type associated with device type xpu" (Gloo serves cpu and cuda
    only). Cleared, the Gloo group is unbound and its collectives (and ``barrier``, which
    takes a bound device as its own, 5332-5334) stay on the CPU. Only the Python-side
    record changes: each backend got its own copy when it was registered
    (ProcessGroup.hpp ``setBackend``), so the default group's XCCL keeps its device.
    ezpz clears it the same way around ``init_device_mesh`` (``init_device_mesh_safe``,
    PR #149). Called on the main thread between steps (checkpoint saves), when no other
    group is being made."""
    import torch.distributed as tdist

    default = tdist.group.WORLD
    bound = getattr(default, "bound_device_id", None)
    if default is None or bound is None:  # no WORLD group has no bound device either
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


@contextmanager
def _lazy_gloo() -> Iterator[None]:
    """Gloo groups made inside connect their pairs on first use (torch reads
    ``TORCH_GLOO_LAZY_INIT`` when it makes a group's device; ``new_group`` takes no Gloo
    options). The caller's own setting is restored after."""
    old = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = old
