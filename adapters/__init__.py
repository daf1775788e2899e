"""Framework adapters. `select_adapter` picks one from the model and optimizer objects."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .base import Adapter, AdapterContext, GradTaps, MonitoredParam, StepEvents
from .wrapped import unwrap_optimizer

#: (adapter, the module its framework's objects cannot exist without), tried in order; the first whose
#: `detect` accepts the objects wins. Plain PyTorch/DDP is last, as the fallback. An adapter is imported
#: only when tried, and not even then while its framework is not imported (~0.1 MB each); each imports
#: its framework lazily.
ADAPTERS = (
    ("trainermon.adapters.fsdp.fsdp2:Fsdp2Adapter", "torch.distributed.fsdp"),
    ("trainermon.adapters.fsdp.fsdp1:Fsdp1Adapter", "torch.distributed.fsdp"),
    ("trainermon.adapters.megatron:MegatronAdapter", "megatron.core"),
    ("trainermon.adapters.deepspeed:DeepSpeedAdapter", "deepspeed"),
    ("trainermon.adapters.torch_ddp:TorchAdapter", "torch"),
)


def _load(spec: str) -> type[Adapter]:
    module, cls = spec.split(":")
    return getattr(importlib.import_module(module), cls)


def _candidates() -> list[str]:
    """The adapters that could handle objects in this process: those whose framework is imported."""
    return [spec for spec, framework in ADAPTERS if framework in sys.modules]


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
