"""Framework adapters. `select_adapter` picks one from the model and optimizer objects."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from .base import Adapter, AdapterContext, GradTaps, MonitoredParam, StepEvents

#: Tried in order; the first whose `detect` accepts the objects wins. Plain PyTorch/DDP is last, as the
#: fallback. Framework adapters are imported only when tried, and each imports its framework lazily.
ADAPTERS = (
    "trainermon.adapters.fsdp.fsdp2:Fsdp2Adapter",
    "trainermon.adapters.fsdp.fsdp1:Fsdp1Adapter",
    "trainermon.adapters.megatron:MegatronAdapter",
    "trainermon.adapters.deepspeed:DeepSpeedAdapter",
    "trainermon.adapters.torch_ddp:TorchAdapter",
)


def _load(spec: str) -> type[Adapter]:
    module, cls = spec.split(":")
    return getattr(importlib.import_module(module), cls)


def select_adapter(
    chunks: Sequence[torch.nn.Module], optimizer: Any, context: AdapterContext | None = None
) -> Adapter:
    context = context or AdapterContext()
    for spec in ADAPTERS:
        cls = _load(spec)
        if cls.detect(chunks, optimizer):
            return cls(chunks, optimizer, context)
    raise TypeError(
        f"trainermon: no adapter handles model {[type(c).__name__ for c in chunks]} with optimizer "
        f"{type(optimizer).__name__}"
    )


__all__ = ["Adapter", "AdapterContext", "GradTaps", "MonitoredParam", "StepEvents", "select_adapter"]
