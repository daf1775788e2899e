"""Optimizer steps that are no training steps: DCP making a fresh optimizer's state (lr 0, zero grads).

`torch.distributed.checkpoint.state_dict.get_state_dict` / `set_state_dict` (DCP resume: torchtitan,
accelerate) call `_init_optim_state` on an optimizer without state: it gives every parameter a zero
gradient and calls `optimizer.step()` with lr 0, so that the state exists to be filled. Its step hooks
fire: counted, that step would shift every family's step numbers by one. The monitor wraps that function
while it is attached (`watch`), and the step hooks ask `state_init_step` whether such a call is running.

The module is not imported for this (importing it costs ~1.7 s): when it is not imported yet at
`watch`, it is wrapped at the first step of an optimizer without state after it was imported (then that
very step is decided from the stack, once).

DCP may be given a wrapper (accelerate's `AcceleratedOptimizer`) while the hooks see the torch optimizer
inside it: the wrapper's whole `.optimizer` chain counts as the optimizer DCP is stepping.
"""

from __future__ import annotations

import sys
from typing import Any

from .wrapped import MAX_DEPTH

MODULE = "torch.distributed.checkpoint.state_dict"
FUNCTION = "_init_optim_state"

_running: list[Any] = []  # optimizers (and those inside them) whose state `_init_optim_state` is making now
_stacked: list[tuple[Any, Any]] = []  # (optimizer, code) found on the stack (wrapped late), until its end
_watchers = [0]  # attached monitors
_installed: list[tuple[Any, Any, Any]] = []  # (module, original function, wrapper) while wrapped
#: The step hooks call `state_init_step` only when it may answer True, a list index or two per step:
#: `maybe[0]`, a call runs (or was found on the stack); `late[0]`, the module is still to be wrapped,
#: which matters to the pre-hooks of an optimizer without state (`not optimizer.state`).
maybe = [False]
late = [False]


def _refresh() -> None:
    maybe[0] = bool(_running or _stacked)
    late[0] = bool(_watchers[0] and not _installed)


def state_init_step(optimizer: Any, end: bool = False) -> bool:
    """Whether this `step()` of `optimizer` is DCP's state initialisation (no training step). `end`: the
    step's last hook asks (forget it). Called only while `maybe[0]` (or `late[0]` and the optimizer has
    no state, from a pre-hook): a few list truth tests; while the module is not wrapped and `optimizer`
    has no state (its first step, or every step of a stateless one), a `sys.modules` lookup."""
    if _running:
        return any(o is optimizer for o in _running)
    if _stacked:
        entry = next((e for e in _stacked if e[0] is optimizer), None)
        if entry is None:
            return False
        # the post-hook ends it; a step that raised never got there: gone from the stack, it ends now
        live = end or _on_stack(optimizer, entry[1])
        if end or not live:
            _stacked[:] = [e for e in _stacked if e[0] is not optimizer]
            _refresh()
        return live
    if _installed or not _watchers[0] or getattr(optimizer, "state", True):
        return False
    return _late(optimizer)


def _late(optimizer: Any) -> bool:
    """The module imported after `watch`: wrap it now, and look for this call on the stack (once)."""
    module = sys.modules.get(MODULE)
    original = getattr(module, FUNCTION, None)
    if not callable(original):
        return False
    _install(module)
    code = getattr(original, "__code__", None)
    if code is None or not _on_stack(optimizer, code):
        return False
    _stacked.append((optimizer, code))
    _refresh()
    return True


def _chain(optim: Any) -> list[Any]:
    """`optim` and the optimizers inside it (`.optimizer`, as `wrapped.unwrap_optimizer` follows it)."""
    chain = [optim]
    inner = getattr(optim, "optimizer", None)
    while inner is not None and len(chain) < MAX_DEPTH and not any(inner is o for o in chain):
        chain.append(inner)
        inner = getattr(inner, "optimizer", None)
    return chain


def _on_stack(optimizer: Any, code: Any) -> bool:
    """Whether a call of `code` (`_init_optim_state`) for `optimizer` or a wrapper of it is running: a walk
    up the stack (the late path only, while that step runs)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and any(o is optimizer for o in _chain(frame.f_locals.get("optim"))):
            return True
        frame = frame.f_back
    return False


def _install(module: Any) -> None:
    original = getattr(module, FUNCTION)

    def init_optim_state(optim: Any, *args: Any, **kwargs: Any) -> Any:
        chain = _chain(optim)
        _running.extend(chain)
        maybe[0] = True
        try:
            return original(optim, *args, **kwargs)
        finally:
            for inner in chain:  # by identity: `list.remove` would compare with `==`
                index = next(i for i, o in enumerate(_running) if o is inner)
                del _running[index]
            _refresh()

    init_optim_state.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, FUNCTION, init_optim_state)
    _installed.append((module, original, init_optim_state))
    _refresh()


class _Watch:
    def __init__(self) -> None:
        self.live = True

    def remove(self) -> None:
        if not self.live:
            return
        self.live = False
        _watchers[0] -= 1
        if _watchers[0] == 0 and _installed:
            module, original, wrapper = _installed.pop()
            if getattr(module, FUNCTION, None) is wrapper:  # else someone wrapped it after us: leave it
                setattr(module, FUNCTION, original)
        _refresh()


def watch() -> _Watch:
    """Follow DCP's state initialisation while the returned handle is not removed (`.remove()`): wraps
    the function when its module is imported already (once for all monitors). Costs nothing per step."""
    _watchers[0] += 1
    if not _installed:
        module = sys.modules.get(MODULE)
        if callable(getattr(module, FUNCTION, None)):
            _install(module)
    _refresh()
    return _Watch()
