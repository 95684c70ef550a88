"""Issue 32, "XPU FSDP2": the default group is bound to the rank's XPU (``device_id``)
after ``set_device``, as ezpz PR #149 found FSDP2 needs on Aurora, and the checkpoint
Gloo group keeps working beside a bound default group.

What a CPU machine can show, and how:

- ``init_process_group`` gets ``device_id=xpu:LOCAL`` on xccl, after ``set_device``, and
  no ``device_id`` on the gloo and nccl paths: through ``ddp.dist.init`` itself, with
  :class:`FakeAccelerator` in place of ``torch.xpu``/``torch.cuda`` and a recorder in
  place of ``init_process_group`` (a CPU build can make neither an XCCL nor an NCCL group).
- The checkpoint group beside a bound default group: two REAL processes on Gloo. torch
  refuses ``device_id=torch.device("cpu")`` ("init_process_group device_id parameter must
  be an accelerator with an index", distributed_c10d.py 2014-2017) and a CPU build refuses
  any accelerator one (1812-1817), so the worker binds its default group the way
  ``init_process_group`` does itself (``pg.bound_device_id = device_id``, 2095-2096) to
  ``xpu:LOCAL``, the group's backend string giving it a backend for xpu as XCCL's group
  has one. That is the state ``new_group`` reads (5963-5964), and where the unprotected
  ``new_group(backend="gloo")`` fails, which the worker also checks.

What only an XPU node can show: that xccl with the binding runs FSDP2's first all-gather
without the hang (ezpz's Aurora job 8518207), and that torch's XCCL backend does not mind
the checkpoint group's making (``tests/gpu`` has no XPU runner).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp import backends, dist
from ddp.env import DistEnv

ROOT = Path(__file__).resolve().parents[2]


class FakeAccelerator:
    """``torch.xpu`` (or ``torch.cuda``) of a node with ``count`` devices, as ddp.backends
    and ddp.dist use it: ``is_available()`` True, ``device_count()`` ``count``, and
    ``set_device(d)``, which the runtime makes the current device (recorded here in
    ``calls``, beside the recorded ``init_process_group``, so the order shows)."""

    def __init__(self, count: int, calls: list[tuple[str, Any]]) -> None:
        self.count = count
        self.calls = calls

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def set_device(self, device: torch.device | int) -> None:
        self.calls.append(("set_device", torch.device(device)))


@pytest.mark.parametrize(
    ("device", "backend", "bound"),
    [
        (torch.device("xpu", 3), "xccl", torch.device("xpu", 3)),
        (torch.device("xpu", 0), "xccl", torch.device("xpu", 0)),
        (torch.device("xpu"), "xccl", None),  # no index: nothing to bind to
        (torch.device("xpu", 1), "ccl", None),  # oneCCL bindings: not what ezpz #149 fixed
        (torch.device("xpu", 1), "gloo", None),  # Gloo has no xpu backend
        (torch.device("cuda", 1), "nccl", None),
        (torch.device("cpu"), "gloo", None),
    ],
)
def test_the_rule_binds_xpu_on_xccl_only(
    device: torch.device, backend: str, bound: torch.device | None
) -> None:
    assert dist.bound_device(device, backend) == bound


def _init_recorded(
    monkeypatch: pytest.MonkeyPatch, node: str, device: str, backend: str, local_rank: int
) -> list[tuple[str, Any]]:
    """``ddp.dist.init`` of rank ``local_rank`` of 4 on a node with 4 fake ``node``
    devices (``xpu`` or ``cuda``; ``cpu``: none); what it did, in order: set_device, then
    init_process_group's kwargs."""
    import torch.distributed as tdist

    from ddp import agree

    calls: list[tuple[str, Any]] = []
    if node != "cpu":  # the CPU build's own torch.xpu/torch.cuda say not available
        monkeypatch.setattr(torch, node, FakeAccelerator(4, calls))
    monkeypatch.setattr(backends, "_xccl_builtin", lambda: True)  # an XPU build has it
    monkeypatch.setattr(tdist, "is_nccl_available", lambda: True)  # a CUDA build has it
    monkeypatch.setattr(
        tdist, "init_process_group", lambda **kw: calls.append(("init_process_group", kw))
    )
    # The rendezvous and the side groups are not under test (and want real peers).
    monkeypatch.setattr(dist, "resolve_master", lambda info: (info, info.master_addr))
    monkeypatch.setattr(dist, "rendezvous_store", lambda *a, **k: tdist.HashStore())
    monkeypatch.setattr(agree, "build", lambda *a, **k: None)
    monkeypatch.setattr(dist.atexit, "register", lambda fn: None)
    monkeypatch.setattr(dist, "_CONTEXT", None)
    monkeypatch.delenv("DDP_RANK_LOGS", raising=False)
    for key in ("CCL_SEND", "CCL_RECV"):  # set on torch 2.8 only; undone after the test
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    env = DistEnv(
        rank=local_rank,
        local_rank=local_rank,
        world_size=4,
        local_world_size=4,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        launcher="torchrun",
    )
    for key in env.torchrun_vars():  # init exports them; undone after the test (they
        monkeypatch.setenv(key, "x")  # leaked RANK=2 WORLD_SIZE=4 into later tests'
        monkeypatch.delenv(key)  # local ranks: test_python_api)
    try:
        dist.init(backend=backend, device=device, env=env, exit_on_error=False)
    finally:
        monkeypatch.setattr(dist, "_CONTEXT", None)
    return calls


@pytest.mark.parametrize("local_rank", [0, 3])
def test_xccl_default_group_is_bound_to_this_ranks_xpu_after_set_device(
    monkeypatch: pytest.MonkeyPatch, local_rank: int
) -> None:
    """device auto -> xpu:LOCAL, backend auto -> xccl: set_device(xpu:LOCAL) first, then
    init_process_group(..., device_id=xpu:LOCAL) (ezpz #149's order)."""
    calls = _init_recorded(monkeypatch, "xpu", "auto", "auto", local_rank)
    assert [name for name, _ in calls] == ["set_device", "init_process_group"]
    xpu = torch.device("xpu", local_rank)
    assert calls[0][1] == xpu
    kwargs = calls[1][1]
    assert kwargs["backend"] == "xccl" and kwargs["device_id"] == xpu
    assert kwargs["rank"] == local_rank and kwargs["world_size"] == 4


@pytest.mark.parametrize(
    ("node", "device", "backend", "expected"),
    [
        ("xpu", "xpu", "gloo", ("xpu:2", "gloo")),  # an XPU rank on Gloo: Gloo cannot serve xpu
        ("cuda", "auto", "auto", ("cuda:2", "nccl")),  # NCCL's binding: another change
        ("cpu", "auto", "auto", ("cpu", "gloo")),
    ],
)
def test_no_device_id_on_gloo_and_nccl(
    monkeypatch: pytest.MonkeyPatch, node: str, device: str, backend: str, expected: tuple[str, str]
) -> None:
    calls = _init_recorded(monkeypatch, node, device, backend, 2)
    (kwargs,) = [kw for name, kw in calls if name == "init_process_group"]
    set_to = [str(d) for name, d in calls if name == "set_device"]
    assert (set_to or ["cpu"], kwargs["backend"]) == ([expected[0]], expected[1])
    assert "device_id" not in kwargs


def test_checkpoint_group_works_beside_a_bound_default_group(tmp_path: Path) -> None:
    """Two real Gloo ranks, the default group bound to xpu:LOCAL (see the module's
    docstring): ``ddp.dist.checkpoint_group()`` is made, its collectives run on the CPU,
    the default group is bound again afterwards, and the same ``new_group`` without
    :func:`ddp.dist._unbound_default_group` fails as torch's source says it does."""
    from tests.ddp.launch_utils import clean_env
    from tests.support.ports import free_port

    port = free_port()
    env = clean_env(PYTHONPATH=f"{ROOT / 'src'}:{ROOT}")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=120)[0])  # a bound against a hang only
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    unprotected = []
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["gathered"] == [0, 1] and got["broadcast"] == "from rank 0"
        assert got["reduced"] == 1.0 + 2.0
        assert got["group_bound"] is None  # the Gloo group is on the CPU
        assert got["default_bound_after"] == f"xpu:{rank}"  # the binding is back
        unprotected.append(got["unprotected"])
    # unprotected, new_group fails on every rank; torch's own reason on at least one (a
    # rank whose peer had already raised may see the pair closed instead)
    assert "made" not in unprotected, unprotected
    assert any("No backend type associated with device type xpu" in u for u in unprotected), (
        unprotected
    )


def _worker(rank: int, port: int, out: Path) -> None:
    """One rank of :func:`test_checkpoint_group_works_beside_a_bound_default_group`."""
    import torch.distributed as tdist

    real_init = tdist.init_process_group

    def bound_init(**kwargs: Any) -> None:
        # a backend for xpu in the default group, as XCCL's has; bound as torch binds it
        real_init(**{**kwargs, "backend": "cpu:gloo,xpu:gloo"})
        tdist.group.WORLD.bound_device_id = torch.device("xpu", rank)

    tdist.init_process_group = bound_init
    env = DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=port,
        launcher="torchrun",
    )
    dist.init(backend="gloo", device="cpu", env=env, timeout=60, exit_on_error=False)
    assert tdist.group.WORLD.bound_device_id == torch.device("xpu", rank)
    group = dist.checkpoint_group()
    gathered: list[Any] = [None, None]
    tdist.all_gather_object(gathered, rank, group=group)
    box = ["from rank 0" if rank == 0 else None]
    tdist.broadcast_object_list(box, src=0, group=group)
    value = torch.tensor([float(rank + 1)])
    tdist.all_reduce(value, group=group)
    tdist.barrier(group=group)
    try:
        tdist.new_group(backend="gloo")  # what checkpoint_group did before the fix
        unprotected = "made"
    except RuntimeError as exc:
        unprotected = str(exc).splitlines()[0]
    # neither rank leaves before the other has tried: a rank that raised and exited at
    # once closed the pair its peer was still connecting ("connectFullMesh failed ...
    # Connection closed"), one CI run in several
    with contextlib.suppress(RuntimeError):
        tdist.barrier(group=group)
    bound = tdist.group.WORLD.bound_device_id
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "gathered": gathered,
                "broadcast": box[0],
                "reduced": value.item(),
                "group_bound": None
                if group.bound_device_id is None
                else str(group.bound_device_id),
                "default_bound_after": str(bound),
                "unprotected": unprotected,
            }
        )
    )
    dist.shutdown()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
