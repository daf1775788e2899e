"""Framework adapters. `select_adapter` picks one from the model and optimizer objects."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .base import Adapter, AdapterContext, GradTaps, MonitoredParam, StepEvents
from .wrapped import unwrap_optimizer

#: Tried in order; the first whose `detect` accepts the objects wins. Plain PyTorch/DDP is last, as the
#: fallback. Framework adapters are imported only when tried, and each imports its framework lazily.
ADAPTERS = (
    "trainermon.adapters.fsdp.fsdp2:Fsdp2Adapter",
    "trainermon.adapters.fsdp.fsdp1:Fsdp1Adapter",
    "trainermon.adapters.megatron:MegatronAdapter",
    "trainermon.adapters.deepspeed:DeepSpeedAdapter",
    "trainermon.adapters.torch_ddp:TorchAdapter",
)
#: The module a framework's objects cannot exist without: an adapter is not even imported (~0.1 MB each)
#: while its framework is not.
FRAMEWORK_OF = {
    "trainermon.adapters.fsdp.fsdp2:Fsdp2Adapter": "torch.distributed.fsdp",
    "trainermon.adapters.fsdp.fsdp1:Fsdp1Adapter": "torch.distributed.fsdp",
    "trainermon.adapters.megatron:MegatronAdapter": "megatron.core",
    "trainermon.adapters.deepspeed:DeepSpeedAdapter": "deepspeed",
}


def _load(spec: str) -> type[Adapter]:
    module, cls = spec.split(":")
    return getattr(importlib.import_module(module), cls)


def _candidates() -> list[str]:
    """The adapters that could handle objects in this process: those whose framework is imported."""
    return [spec for spec in ADAPTERS if FRAMEWORK_OF.get(spec, "torch") in sys.modules]


def owned_by_an_adapter(optimizer: Any) -> bool:
    """A framework optimizer that an adapter reads itself (not to be unwrapped further)."""
    return any(_load(spec).owns_optimizer(optimizer) for spec in _candidates())


def select_adapter(
    chunks: Sequence[torch.nn.Module], optimizer: Any, context: AdapterContext | None = None
) -> Adapter:
    """The adapter for these objects; a wrapped optimizer is unwrapped first (`wrapped.unwrap_optimizer`),
    and the chain is kept as `adapter.optimizer_chain` for the attach log line."""
    context = context or AdapterContext()
    chain = unwrap_optimizer(optimizer, owned_by_an_adapter)
    optimizer = chain[-1]
    for spec in _candidates():
        cls = _load(spec)
        if cls.detect(chunks, optimizer):
            adapter = cls(chunks, optimizer, context)
            adapter.optimizer_chain = chain
            return adapter
    raise TypeError(
        f"trainermon: no adapter handles model {[type(c).__name__ for c in chunks]} with optimizer "
        f"{type(optimizer).__name__}"
    )


__all__ = ["Adapter", "AdapterContext", "GradTaps", "MonitoredParam", "StepEvents", "select_adapter"]
