"""Optimizers handed over inside wrappers: accelerate's `AcceleratedOptimizer` (and its DeepSpeed, FSDP and
Megatron variants), Lightning's `LightningOptimizer`, or any object that holds the real optimizer as
`.optimizer`.

The wrappers are peeled until an object whose step the monitor can hook: a torch optimizer that was
initialised as one (accelerate's wrapper subclasses `torch.optim.Optimizer` without running its
`__init__`, so torch's step hooks do not exist on it), or a framework optimizer an adapter reads itself
(Megatron's, DeepSpeed's: `Adapter.owns_optimizer`). Hooking the inner optimizer is also what keeps the
steps aligned: accelerate's wrapper calls it only at the gradient-accumulation boundary, and only when
its loss scaler did not skip the update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: More nesting than any framework uses: a guard against objects whose `.optimizer` leads in circles.
MAX_DEPTH = 8


def hookable(optimizer: Any) -> bool:
    """A torch optimizer whose step hooks exist (its `Optimizer.__init__` ran)."""
    return isinstance(optimizer, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(optimizer)


def unwrap_optimizer(optimizer: Any, owned: Callable[[Any], bool] = lambda o: False) -> list[Any]:
    """The chain from `optimizer` to the object to hook (last): `.optimizer` is followed while the current
    object is neither `hookable` nor `owned` by an adapter."""
    chain = [optimizer]
    current = optimizer
    while current is not None and not hookable(current) and not owned(current):
        inner = getattr(current, "optimizer", None)
        if inner is None or any(inner is seen for seen in chain) or len(chain) >= MAX_DEPTH:
            break
        chain.append(inner)
        current = inner
    return chain


def describe_chain(chain: list[Any], hooked: Any) -> str:
    """`AcceleratedOptimizer -> AdamW` (and what the adapter steps through, when that is another object:
    DeepSpeed's engine optimizer found from the model)."""
    text = " -> ".join(type(o).__name__ for o in chain)
    if hooked is not None and all(hooked is not o for o in chain):
        through = type(hooked).__name__
        text = f"{text} (steps through {through})" if text else through
    return text
