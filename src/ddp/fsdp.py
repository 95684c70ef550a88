"""FSDP2 behind ``ddp.wrap(model, strategy="fsdp")``: models bigger than one device.

DDP keeps a full copy of the parameters, gradients and optimizer state on every rank;
FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps 1/world of each and gathers a
block's parameters only while that block runs. As in torchtitan, each block the user
names is sharded on its own (so only one block is ever gathered at a time), then the
root (for the parameters outside the blocks).

Which modules are blocks (``blocks``):

- ``None`` (default): every ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``,
  else every child of every ``nn.ModuleList`` (the usual stack of layers);
- a module class, or a class name (``"TransformerEncoderLayer"``);
- a list of qualified module names (``["layers.0", "layers.1"]``) or class names
  (``ddp.fsdp_blocks: [TransformerEncoderLayer]`` in a config);
- a callable ``(name, module) -> bool``.

One process (world 1) gets the plain model, as with DDP. Sharded checkpoints are
written with ``torch.distributed.checkpoint`` (:mod:`ddp.checkpoint.manager`) and reshard on
load, so a run may resume on a different number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from ddp.errors import ConfigError

BlockSpec = type[nn.Module] | str | Sequence[str] | Callable[[str, nn.Module], bool] | None

_DEFAULT_BLOCKS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[nn.Module]:
    """The modules to shard one by one, outermost first, none inside another."""
    named = list(model.named_modules())
    if blocks is None:
        picked: list[nn.Module] = [m for _, m in named if isinstance(m, _DEFAULT_BLOCKS)]
        if not picked:
            picked = [c for _, m in named if isinstance(m, nn.ModuleList) for c in m]
    elif isinstance(blocks, type):
        cls = cast("type[nn.Module]", blocks)  # a class (a Callable may be one too)
        picked = [m for _, m in named if isinstance(m, cls)]
    elif isinstance(blocks, str):
        picked = [m for _, m in named if type(m).__name__ == blocks]
        if not picked:
            raise ConfigError(f"ddp.fsdp_blocks: no module of class {blocks!r} in the model")
    elif callable(blocks):
        picked = [m for name, m in named if name and blocks(name, m)]
    else:  # names: a module's qualified name, else a class name
        by_name = dict(named)
        classes = {type(m).__name__ for _, m in named}
        missing = [n for n in blocks if n not in by_name and n not in classes]
        if missing:
            raise ConfigError(
                f"ddp.fsdp_blocks: {missing[0]!r} is neither a module nor a module class of "
                "this model; allowed: qualified names such as "
                + ", ".join(repr(n) for n, _ in named[1:4])
                + ", or a class name such as "
                + repr(type(named[-1][1]).__name__)
            )
        picked = [by_name[n] for n in blocks if n in by_name]
        picked += [m for _, m in named if type(m).__name__ in blocks and m not in picked]
    # Keep the outermost: a block inside another block is sharded with its parent.
    inner = {id(sub) for m in picked for sub in m.modules() if sub is not m}
    return [m for m in picked if id(m) not in inner and m is not model]


def shard(
    model: nn.Module,
    device: torch.device,
    world_size: int,
    blocks: BlockSpec = None,
    reshard_after_forward: bool = True,
    mixed_precision: str = "none",
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Apply ``fully_shard`` to each block and the root over a 1-D mesh of all ranks.

    ``mixed_precision="bf16"``: parameters gathered in bf16, gradients reduced in fp32
    (FSDP2's ``MixedPrecisionPolicy``). ``cpu_offload`` keeps the shards and optimizer
    step on the CPU (GPU/XPU only). ``activation_checkpointing`` recomputes each block in
    backward instead of storing its activations.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if mixed_precision not in ("none", "bf16"):
        raise ConfigError(f"ddp.fsdp_mixed_precision: {mixed_precision!r}; allowed: none, bf16")
    if cpu_offload and device.type == "cpu":
        raise ConfigError("ddp.cpu_offload: the model is on the CPU already; allowed: false")
    mesh = init_device_mesh(device.type, (world_size,))
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    found = find_blocks(model, blocks)
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in found:
            checkpoint(block)
    for block in found:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True for a model (or one inside a wrapper) that ``fully_shard`` was applied to."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the whole model's weights, gathered to CPU (every rank gets them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # full_state_dict: every value is a whole tensor (torch types it as any state value)
    return cast("dict[str, torch.Tensor]", get_model_state_dict(model, options=opts))


def local_tensors(model: nn.Module) -> list[torch.Tensor]:
    """This rank's shards of the parameters (plain tensors)."""
    out = []
    for p in model.parameters():
        t = p.detach()
        out.append(t.to_local() if hasattr(t, "to_local") else t)
    return out
