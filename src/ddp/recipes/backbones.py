"""Real image backbones by name for crowdbt: EfficientNet-B0..B7, ResNets, ViTs.

Which library builds them is decided by what imports, in this order, and said once in
the log (:func:`library`):

1. ``torchvision`` (every backbone here; its weights enums name the cached files);
2. ``timm`` (every backbone here; ``set_grad_checkpointing``);
3. ``efficientnet_pytorch`` (EfficientNet only; torch-only, so it imports beside a CPU
   torch where PyPI's torchvision wheels do not: they link the CUDA build of torch and
   fail with ``operator torchvision::nms does not exist``, and timm needs torchvision).

All three build the same architecture for a name (the EfficientNet compound scaling of
width, depth and resolution; the same stages and MBConv blocks). They differ in
details the user should know: ``efficientnet_pytorch`` ports the TensorFlow model with
"same" padding and has its own weight files, so weights are never mixed between
libraries. A backbone no importable library provides is one line naming what to
install: never a silent stand-in.

Every backbone is wrapped as :class:`Backbone`: ``forward(images) -> (B, dim)`` pooled
features, and ``gradient_checkpointing`` recomputes each block (stage, residual layer,
MBConv or transformer block) in backward with :func:`torch.utils.checkpoint.checkpoint`
(non-reentrant, so it preserves the RNG of dropout and drop-connect).

Pretrained weights (``model.pretrained``): ``""`` random init; ``"cache"`` the library's
own file from its local cache (torch hub's ``checkpoints/`` for torchvision and
efficientnet_pytorch, the Hugging Face cache for timm, offline); a path: that file.
Nothing is ever downloaded here: a missing file is one line saying where it was looked
for. Files load with ``torch.load(weights_only=True)`` and must fit the architecture
(only the classifier may be missing or extra).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddp.errors import ConfigError
from hpc_ddp.files import NotRegular, open_regular

log = logging.getLogger("ddp")

#: The resolution each backbone was designed (and its weights trained) at.
INPUT_SIZE: dict[str, int] = {
    "efficientnet_b0": 224,
    "efficientnet_b1": 240,
    "efficientnet_b2": 260,
    "efficientnet_b3": 300,
    "efficientnet_b4": 380,
    "efficientnet_b5": 456,
    "efficientnet_b6": 528,
    "efficientnet_b7": 600,
    "resnet18": 224,
    "resnet34": 224,
    "resnet50": 224,
    "resnet101": 224,
    "resnet152": 224,
    "vit_b_16": 224,
    "vit_b_32": 224,
    "vit_l_16": 224,
    "vit_l_32": 224,
}
NAMES = tuple(INPUT_SIZE)
#: ImageNet statistics: what every listed backbone's own preprocessing normalises with.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
#: timm's names for torchvision's ViT spellings (the ResNet/EfficientNet names agree).
_TIMM = {
    "vit_b_16": "vit_base_patch16_224",
    "vit_b_32": "vit_base_patch32_224",
    "vit_l_16": "vit_large_patch16_224",
    "vit_l_32": "vit_large_patch32_224",
}
MAX_WEIGHTS = 4 << 30
"""Largest weights file read (EfficientNet-B7 is 260 MB, ViT-L 1.2 GB)."""


@functools.cache
def library() -> str | None:
    """The first of torchvision, timm, efficientnet_pytorch that imports, else None.

    Any exception counts as "does not import": torchvision's failure beside a CPU torch
    is a RuntimeError raised while it registers its operators, not an ImportError.
    """
    for name in ("torchvision", "timm", "efficientnet_pytorch"):
        try:
            __import__(name)
        except Exception as exc:
            log.debug("backbones: %s does not import: %s", name, exc)
            continue
        log.info("crowdbt: backbones from %s", name)
        return name
    return None


def input_size(name: str) -> int:
    """The backbone's own input size (300/380/456 for B3/B4/B5)."""
    return INPUT_SIZE[name]


def check_name(name: str) -> str:
    """The library that builds ``name``; one line naming what to install otherwise."""
    if name not in INPUT_SIZE:
        raise ConfigError(
            f"model.backbone: {name!r} is not a backbone; allowed: tiny_cnn, " + ", ".join(NAMES)
        )
    lib = library()
    if lib in ("torchvision", "timm"):
        return lib
    if lib == "efficientnet_pytorch" and name.startswith("efficientnet_"):
        return lib
    need = (
        "torchvision (built for your torch) or timm"
        if lib
        else "torchvision (built for your torch), timm, or efficientnet_pytorch (pip install "
        "hpc-ddp[crowdbt])"
    )
    raise ConfigError(f"model.backbone: {name!r} needs {need}; none that builds it imports here")


class Backbone(nn.Module):
    """A library model cut before its classifier: ``stem -> blocks -> head`` -> (B, dim).

    ``blocks`` is what gradient checkpointing recomputes one at a time; ``stem`` and
    ``head`` are callables over the library model's own modules (kept as submodules of
    ``net``, so ``state_dict`` keys are the library's, prefixed ``net.``).
    """

    def __init__(
        self,
        net: nn.Module,
        blocks: Sequence[nn.Module],
        dim: int,
        stem: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
        block_call: Callable[[nn.Module, int, torch.Tensor], torch.Tensor] | None = None,
        native_ckpt: Callable[[bool], None] | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self._blocks = list(blocks)  # plain list: the modules are registered under net
        self.dim = dim
        self._stem, self._head = stem, head
        self._call = block_call or (lambda block, _i, x: block(x))
        self._native = native_ckpt
        self._ckpt = False

    @property
    def gradient_checkpointing(self) -> bool:
        return self._ckpt

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        self._ckpt = bool(value)
        if self._native is not None:
            self._native(self._ckpt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is not None:  # timm checkpoints inside its own forward_features
            return self._head(self._stem(x))
        x = self._stem(x)
        for i, block in enumerate(self._blocks):
            if self._ckpt and self.training and torch.is_grad_enabled():
                x = checkpoint(self._call, block, i, x, use_reentrant=False)
            else:
                x = self._call(block, i, x)
        return self._head(x)


# ---- builders, one per library ------------------------------------------------------------
def build(name: str, size: int, pretrained: str = "") -> Backbone:
    """The backbone ``name`` for ``size`` x ``size`` inputs, weights as ``pretrained`` says."""
    lib = check_name(name)
    if lib == "torchvision":
        return _torchvision(name, size, pretrained)
    if lib == "timm":
        return _timm(name, size, pretrained)
    return _efficientnet_pytorch(name, size, pretrained)


def _efficientnet_pytorch(name: str, size: int, pretrained: str) -> Backbone:
    from efficientnet_pytorch import EfficientNet
    from efficientnet_pytorch import utils as eu

    lib_name = name.replace("_", "-")
    # image_size sets the static "same" padding of every conv for this resolution
    net = EfficientNet.from_name(lib_name, image_size=size)
    if pretrained:
        cached = Path(torch.hub.get_dir()) / "checkpoints" / eu.url_map[lib_name].rsplit("/", 1)[1]
        _load(net, _weights_path(pretrained, cached, name), name, head=("_fc.",))
    net.set_swish(memory_efficient=False)  # its custom autograd swish is not needed here
    dim = net._fc.in_features
    net._fc = nn.Identity()  # the classifier: unused, and DDP refuses parameters with no grad
    drop = net._global_params.drop_connect_rate or 0.0
    n = len(net._blocks)

    def stem(x: torch.Tensor) -> torch.Tensor:
        return net._swish(net._bn0(net._conv_stem(x)))

    def call(block: nn.Module, i: int, x: torch.Tensor) -> torch.Tensor:
        return block(x, drop_connect_rate=drop * i / n if drop else None)  # as its forward

    def head(x: torch.Tensor) -> torch.Tensor:
        return net._avg_pooling(net._swish(net._bn1(net._conv_head(x)))).flatten(1)

    return Backbone(net, list(net._blocks), dim, stem, head, call)


def _torchvision(name: str, size: int, pretrained: str) -> Backbone:
    import torchvision

    kwargs: dict[str, Any] = {"image_size": size} if name.startswith("vit_") else {}
    net = torchvision.models.get_model(name, weights=None, **kwargs)
    if pretrained:
        weights = torchvision.models.get_model_weights(name).DEFAULT
        cached = Path(torch.hub.get_dir()) / "checkpoints" / weights.url.rsplit("/", 1)[1]
        head_keys = (
            ("heads.",)
            if name.startswith("vit_")
            else ("fc.",)
            if name.startswith("resnet")
            else ("classifier.",)
        )
        _load(net, _weights_path(pretrained, cached, name), name, head=head_keys)
    # the classifier is dropped: unused here, and DDP refuses parameters with no gradient
    if name.startswith("efficientnet_"):
        dim = net.classifier[-1].in_features
        net.classifier = nn.Identity()
        return Backbone(
            net, list(net.features), dim, lambda x: x, lambda x: net.avgpool(x).flatten(1)
        )
    if name.startswith("resnet"):

        def stem(x: torch.Tensor) -> torch.Tensor:
            return net.maxpool(net.relu(net.bn1(net.conv1(x))))

        layers = [net.layer1, net.layer2, net.layer3, net.layer4]
        dim = net.fc.in_features
        net.fc = nn.Identity()
        return Backbone(net, layers, dim, stem, lambda x: net.avgpool(x).flatten(1))

    def vit_stem(x: torch.Tensor) -> torch.Tensor:  # VisionTransformer.forward up to its layers
        x = net._process_input(x)
        x = torch.cat([net.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return net.encoder.dropout(x + net.encoder.pos_embedding)

    net.heads = nn.Identity()
    return Backbone(
        net, list(net.encoder.layers), net.hidden_dim, vit_stem, lambda x: net.encoder.ln(x)[:, 0]
    )


def _timm(name: str, size: int, pretrained: str) -> Backbone:
    import timm

    tname = _TIMM.get(name, name)
    kwargs: dict[str, Any] = {"img_size": size} if name.startswith("vit_") else {}
    if pretrained == "cache":
        old = os.environ.get("HF_HUB_OFFLINE")
        os.environ["HF_HUB_OFFLINE"] = "1"  # from the local cache only, never a download
        try:
            net = timm.create_model(tname, pretrained=True, num_classes=0, **kwargs)
        except Exception as exc:
            raise ConfigError(
                f"model.pretrained: timm's {tname} weights are not in the local "
                f"Hugging Face cache ({type(exc).__name__}); allowed: a weights "
                "file (--pretrained PATH) or fetch them first"
            ) from None
        finally:
            if old is None:
                os.environ.pop("HF_HUB_OFFLINE", None)
            else:
                os.environ["HF_HUB_OFFLINE"] = old
    else:
        net = timm.create_model(tname, pretrained=False, num_classes=0, **kwargs)
        if pretrained:
            _load(
                net,
                _weights_path(pretrained, None, name),
                name,
                head=("head.", "fc.", "classifier."),
            )
    return Backbone(
        net,
        [],
        net.num_features,
        net.forward_features,
        lambda x: net.forward_head(x, pre_logits=True),
        native_ckpt=lambda on: net.set_grad_checkpointing(on),
    )


# ---- weights ------------------------------------------------------------------------------
def _weights_path(pretrained: str, cached: Path | None, name: str) -> Path:
    if pretrained != "cache":
        return Path(pretrained)
    if cached is None or not cached.is_file():
        raise ConfigError(
            f"model.pretrained: no cached weights for {name} at {cached}; "
            "allowed: a weights file (--pretrained PATH); nothing is downloaded"
        )
    return cached


def _load(net: nn.Module, path: Path, name: str, head: tuple[str, ...]) -> None:
    """``path``'s tensors into ``net``; only classifier keys (``head``) may differ."""
    try:
        fd, info = open_regular(path)
        os.close(fd)
        if info.st_size > MAX_WEIGHTS:
            raise NotRegular(f"is {info.st_size:,} bytes; allowed: at most {MAX_WEIGHTS:,}")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except NotRegular as exc:
        raise ConfigError(f"model.pretrained: {str(path)!r} {exc}") from None
    except Exception as exc:
        raise ConfigError(
            f"model.pretrained: {str(path)!r} is not a weights file "
            f"({type(exc).__name__}); allowed: a state dict of tensors"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"model.pretrained: {str(path)!r} holds no state dict of tensors")
    state = {re.sub(r"^module\.", "", k): v for k, v in state.items()}
    own = net.state_dict()
    misfit = [
        k
        for k, v in state.items()
        if k in own and own[k].shape != v.shape and not k.startswith(head)
    ]
    state = {k: v for k, v in state.items() if not k.startswith(head)}
    missing = [k for k in own if k not in state and not k.startswith(head)]
    unexpected = [k for k in state if k not in own]
    if misfit or missing or unexpected:
        first = (misfit or missing or unexpected)[0]
        raise ConfigError(
            f"model.pretrained: {str(path)!r} does not fit {name} "
            f"({len(misfit)} misshapen, {len(missing)} missing, {len(unexpected)} "
            f"unexpected keys, e.g. {first!r}); allowed: {name}'s own weights"
        )
    net.load_state_dict(state, strict=False)
    log.info("crowdbt: %s weights from %s", name, path)
