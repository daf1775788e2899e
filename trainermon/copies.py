"""What a copy of a monitored model gets in place of the monitor's hooks.

Users copy models after `set_monitor`: an EMA or SWA model (`torch.optim.swa_utils.AveragedModel`
deep-copies its module), a frozen reference model for RLHF/DPO, `torch.save(model)`. The monitor's hooks
travel in the modules' hook dicts. Copied as they are, a bound method drags the monitor (threads, locks,
open files) into the copy and the copy fails (`cannot pickle '_thread.lock'`), and a closure, shared by
the copy, would record the copy's forwards as the monitored model's. A copy is not monitored: each hook
copies (`copy.deepcopy`) or pickles as a hook that does nothing, or as the copy's own method where the
monitor wrapped one. A second TrainerMon can monitor the copy.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def drop_copied_hooks(module: Any, is_copied: Callable[[Any], bool]) -> None:
    """Removes a copied hook from its module's hook dicts at the hook's first call: a module with any hook
    left leaves torch's fast call path for good (an EMA copy kept 8 inert hooks after close). Safe inside
    the call: torch iterates a tuple made of the dicts' items, except for the hooks it calls after forward
    raised (`always_call`, the dict iterated in place): while an exception is being handled, those stay
    for a later call. Anything that is not a module is left alone, and nothing is removed while dynamo
    traces (it cannot trace a dict deletion: a fullgraph compile of a copy raised); an eager call does it."""
    if not isinstance(module, torch.nn.Module) or torch.compiler.is_compiling():
        return
    always = getattr(module, "_forward_hooks_always_called", {}) if sys.exc_info()[0] is not None else {}
    for attr in _HOOK_DICTS:
        hooks = getattr(module, attr, None)
        if not hooks:
            continue
        for key in [k for k, h in hooks.items() if is_copied(h) and k not in always]:
            del hooks[key]
            for flags in _HOOK_FLAGS:
                getattr(module, flags, {}).pop(key, None)


def _is_inert(hook: Any) -> bool:
    return hook is inert_hook


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """A copied model's hook: returns None (changes nothing), records nothing, and removes itself from the
    module it was called for."""
    if args:
        drop_copied_hooks(args[0], _is_inert)
    return None


def _inert() -> Callable[..., None]:
    return inert_hook


#: What a wrapped method shows of its original besides `__wrapped__` (`functools.WRAPPER_ASSIGNMENTS` less
#: what the class has). Never `__func__`: torch's LRScheduler would step the original, past the wrapper.
_SHOWN = frozenset(("__name__", "__qualname__", "__annotations__", "__type_params__"))


def _same(value: Any) -> Any:
    return value


class CopySafe:
    """A hook or method wrapper installed on a user's module that copies as `inert_hook`, or, for a wrapped
    method (`original`), as the copy's own method. One Python call more per call of the hook: for hooks
    on a few modules (the roots, routers, attention layers), not on every module (`HookedModule` copies
    itself as an inert hook instead).

    A wrapped method keeps the original's signature and name (`__wrapped__`, as
    `functools.wraps` gives): callers decide from `inspect.signature` which arguments to pass (accelerate's
    `AcceleratedOptimizer.zero_grad` looks for `set_to_none`). Read only when asked: no cost per call."""

    __slots__ = ("call", "original")

    def __init__(self, call: Callable[..., Any], original: Callable[..., Any] | None = None) -> None:
        self.call = call
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        # `inspect.signature` / `inspect.unwrap` follow it; a hook (no original) has none to show
        if self.original is None:
            raise AttributeError("__wrapped__")
        return self.original

    def __getattr__(self, name: str) -> Any:
        # only for names the class lacks: `__name__`, `__qualname__` of the original, as `functools.wraps`
        if name in _SHOWN and self.original is not None:
            return getattr(self.original, name)
        raise AttributeError(name)

    def __deepcopy__(self, memo: dict) -> Any:
        # a bound method deep-copies as the method bound to the module's copy (in `memo` already)
        return inert_hook if self.original is None else copy.deepcopy(self.original, memo)

    def __reduce__(self) -> tuple:
        return (_inert, ()) if self.original is None else (_same, (self.original,))
