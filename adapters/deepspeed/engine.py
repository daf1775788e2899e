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


def zero12_grad_dict(opt: Any) -> dict[int, Any]:
    if getattr(opt, "cpu_offload", False):
        # offload_optimizer: the reduced gradients go to the CPU partition's fp32 .grad (views by
        # group); averaged_gradients stays empty
        grads = getattr(opt, "offload_gradient_dict", None)
        return grads if isinstance(grads, dict) else {}
    grads = getattr(opt, "averaged_gradients", None)
    if grads is None:
        grads = getattr(opt, "fp32_groups_gradient_dict", None)
    return grads if isinstance(grads, dict) else {}


def engine_scales_loss(engine: Any) -> bool:
    """Whether the engine's backward multiplies the loss by its optimizer's loss scale. DeepSpeed 0.19
    scales it for its ZeRO optimizers only: with FP16_UnfusedOptimizer (ZeRO-0 fp16) `p.grad` is the
    unscaled gradient (the optimizer's step divides by the scale all the same). Asked of `engine.scale`,
    which applies what backward applies, on a one-element probe (a multiply, once per run); its side flag
    is put back. An engine without `scale` (older DeepSpeed, whose backward scaled through the
    optimizer's own `backward`) or one that fails the probe: True."""
    scale = getattr(engine, "scale", None)
    if not callable(scale):
        return True
    flag = engine.__dict__.get("_manual_backward_expected", _MISSING)
    try:
        param = next(engine.module.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        with torch.enable_grad():
            probe = torch.ones((), device=device, requires_grad=True) * 1.0
            return float(scale(probe).detach()) != 1.0
    except Exception:  # noqa: BLE001 - an engine that cannot say: assume the loss scaled, as before
        return True
    finally:
        if flag is _MISSING:
            engine.__dict__.pop("_manual_backward_expected", None)
        else:
            engine.__dict__["_manual_backward_expected"] = flag


_MISSING = object()
