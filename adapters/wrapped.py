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

import sys
from collections.abc import Callable
from typing import Any

import torch

#: More nesting than any framework uses: a guard against objects whose `.optimizer` leads in circles.
MAX_DEPTH = 8


def _step_wrapper_code() -> Any:
    """The code of the wrapper torch puts around each optimizer class's `step` to run the step hooks
    (`Optimizer.profile_hook_step`); None in a torch without it."""
    make = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    try:
        return make(lambda *args, **kwargs: None).__code__ if make is not None else None
    except Exception:  # noqa: BLE001 - a torch whose wrapper differs: no nesting check
        return None


_STEP_WRAPPER = _step_wrapper_code()


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


def nested_step(optimizer: Any) -> bool:
    """Whether a step hook of `optimizer` runs inside another `step()` call of the same optimizer. torch
    wraps the `step` of the class of every optimizer made, so a subclass whose `step` calls
    `super().step()`, in a process that also made the parent class, runs each step hook twice, nested:
    the inner run must be ignored or one step counts as two. Decided from the stack, not from a counter,
    because a `step()` that raises runs no post-hook. Cost: a look at the class's bases (~0.5 us); the
    stack is walked (~3 us at 40 frames) only when two of them have a wrapped `step`."""
    if _STEP_WRAPPER is None:
        return False
    wrapped = 0
    for cls in type(optimizer).__mro__:  # nesting needs a wrapped step in a base class as well
        wrapped += getattr(vars(cls).get("step"), "hooked", False) is True
    if wrapped < 2:
        return False
    frame = sys._getframe(1)
    outer = 0
    while frame is not None:
        if frame.f_code is _STEP_WRAPPER and frame.f_locals.get("self") is optimizer:
            outer += 1
            if outer > 1:
                return True
        frame = frame.f_back
    return False
