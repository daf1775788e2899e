"""Finding the DeepSpeedEngine behind the objects a user hands to `set_monitor`."""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _deepspeed_loaded() -> bool:
    # Only a program that imported DeepSpeed can hand us its objects; everyone else never imports it.
    return "deepspeed" in sys.modules


def _engine_type() -> type | None:
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except Exception:  # noqa: BLE001 - a broken DeepSpeed install must not break other adapters
        return None
    return DeepSpeedEngine


def is_deepspeed_object(obj: Any) -> bool:
    """The engine or one of DeepSpeed's own optimizer wrappers (ZeRO, BF16, FP16), which the adapter
    reads itself; their `.optimizer` is the basic torch optimizer."""
    if obj is None or not _deepspeed_loaded():
        return False
    engine_type = _engine_type()
    if engine_type is not None and isinstance(obj, engine_type):
        return True
    try:
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    except Exception:  # noqa: BLE001 - older or broken DeepSpeed: the engine check above still holds
        return False
    return isinstance(obj, DeepSpeedOptimizer)


def _optimizer_chain(optimizer: Any) -> list[Any]:
    """The optimizer and what it wraps: Accelerate's DeepSpeedOptimizerWrapper -> ZeRO optimizer ->
    basic torch optimizer (each holds the next as `.optimizer`)."""
    chain: list[Any] = []
    while optimizer is not None and all(optimizer is not o for o in chain) and len(chain) < 8:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def find_engine(chunks: Sequence[Any], optimizer: Any) -> Any | None:
    """The DeepSpeedEngine behind a model (the engine or `engine.module`) and/or an optimizer (the
    engine, `engine.optimizer`, a wrapper of it, or the basic optimizer)."""
    if not _deepspeed_loaded():
        return None
    engine_type = _engine_type()
    if engine_type is None:
        return None
    for chunk in chunks:
        if isinstance(chunk, engine_type):
            return chunk
    chain = _optimizer_chain(optimizer)
    for obj in chain:
        if isinstance(obj, engine_type):
            return obj
        inner = getattr(obj, "engine", None)  # Accelerate's DeepSpeedEngineWrapper
        if isinstance(inner, engine_type):
            return inner
    # engine.module and engine.optimizer hold no reference back to the engine: look for it once, at
    # set_monitor time, among live objects (a linear scan, no stack walks, not on any hot path).
    wanted_modules = {id(c) for c in chunks}
    wanted_opts = {id(o) for o in chain}
    for obj in gc.get_objects():
        # type(), not isinstance(): some lazy module proxies warn when asked for __class__.
        if issubclass(type(obj), engine_type):
            opts = (getattr(obj, "optimizer", None), getattr(obj, "basic_optimizer", None))
            if id(obj.module) in wanted_modules or any(o is not None and id(o) in wanted_opts for o in opts):
                return obj
    return None


# ==== per-kind access to the optimizer-side tensors ==============================================
@dataclass(frozen=True)
class OptimizerKind:
    name: str  # "torch", "fp16_wrapper", "zero12", "zero3"
    grad_keeps_sum: bool  # .grad holds the sum over the step's micro-batches at the boundary


def classify_optimizer(optimizer: Any) -> OptimizerKind:
    if isinstance(optimizer, torch.optim.Optimizer):
        return OptimizerKind("torch", True)
    if hasattr(optimizer, "fp32_partitioned_groups_flat") and hasattr(optimizer, "grad_position"):
        return OptimizerKind("zero3", False)
    if hasattr(optimizer, "bit16_groups") and hasattr(optimizer, "single_partition_of_fp32_groups"):
        # ZeRO-1 reduces once at the boundary, from the .grad that autograd accumulated; ZeRO-2 reduces
        # (and frees .grad) every micro-batch.
        return OptimizerKind("zero12", not getattr(optimizer, "partition_gradients", True))
    if hasattr(optimizer, "bf16_groups") and hasattr(optimizer, "fp32_groups_flat_partition"):
        # BF16_Optimizer moves .grad into its fp32 buffer every micro-batch
        return OptimizerKind("zero12", False)
    if hasattr(optimizer, "fp16_groups") and isinstance(getattr(optimizer, "fp32_groups", None), list):
        return OptimizerKind("fp16_wrapper", True)
    raise TypeError(f"trainermon: unsupported DeepSpeed optimizer {type(optimizer).__name__}")
