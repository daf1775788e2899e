"""Loss-scaler calls, watched at class level while a skip probe is attached.

`GradScaler.step(optimizer)` and `GradScaler.unscale_(optimizer)` are wrapped on `torch.amp.GradScaler`
(which `torch.cuda.amp.GradScaler` inherits) and on each loaded subclass that defines its own (FSDP's
`ShardedGradScaler` has its own `unscale_`). Each attached probe is told of every call:

- `scaler_step(optimizer)` before a scaler's step: a skip until the next boundary is the scaler's;
- `scaler_unscaled(scaler, optimizer)` after an explicit `unscale_`: the loop may then skip
  `scaler.step` itself on a non-finite clip norm, and the scaler's `found_inf` says whether that skip
  is a routine overflow (the probe keeps the tensors; it reads them only on a skipped step).

A subclass loaded later (FSDP's `sharded_grad_scaler` is imported by the user, often after
`set_monitor`; a user's own scaler class) is wrapped when its first instance is built: `GradScaler.__init__`,
which every subclass reaches through `super().__init__`, is watched too.

Cost: one Python call more per scaler call, nothing while no probe is attached. The wrappers never
raise into the training loop: a failing probe is passed over. The listeners are held weakly (a monitor
dropped without `close()` is not kept alive by the class-level wrappers; once collected, its watch is
removed as by `remove()` at the next set_monitor or close).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Protocol

import torch

from .lifecycle import later

WATCHED = ("step", "unscale_")


class ScalerListener(Protocol):
    def scaler_step(self, optimizer: Any) -> None: ...

    def scaler_unscaled(self, scaler: Any, optimizer: Any) -> None: ...


_LISTENERS: list[weakref.ref] = []  # the attached probes (weakly: see the module docstring)
#: (class, method name) -> (that class's own method before wrapping, the wrapper put in its place)
_WRAPPED: dict[tuple[type, str], tuple[Any, Any]] = {}


def _scaler_classes(name: str) -> list[type]:
    """`torch.amp.GradScaler` and its loaded subclasses that define their own `name`."""
    base = torch.amp.GradScaler
    found, todo = [base], list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if name in cls.__dict__ and cls not in found:
            found.append(cls)
    return found


def _tell_step(scaler: Any, optimizer: Any) -> None:
    for ref in tuple(_LISTENERS):
        try:
            if (listener := ref()) is not None:
                listener.scaler_step(optimizer)
        except Exception:  # noqa: BLE001, S110 - never into the training loop; the skip is then reported
            pass


def _tell_unscaled(scaler: Any, optimizer: Any) -> None:
    for ref in tuple(_LISTENERS):
        try:
            if (listener := ref()) is not None:
                listener.scaler_unscaled(scaler, optimizer)
        except Exception:  # noqa: BLE001, S110 - never into the training loop; the skip is then reported
            pass


def _watch_class(cls: type) -> None:
    """Wrap `cls`'s own `step` / `unscale_` where not yet wrapped (a subclass loaded after the watch)."""
    for name in WATCHED:
        own = cls.__dict__.get(name)
        if own is not None and (cls, name) not in _WRAPPED and not _is_ours(own):
            wrapper = _wrap(name, own)
            _WRAPPED[(cls, name)] = (own, wrapper)
            setattr(cls, name, wrapper)


def _is_ours(method: Any) -> bool:
    return any(method is wrapper for _, wrapper in _WRAPPED.values())


def _wrap_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(scaler: Any, *args: Any, **kwargs: Any) -> None:
        original(scaler, *args, **kwargs)
        if _LISTENERS:
            try:
                for cls in type(scaler).__mro__:
                    if issubclass(cls, torch.amp.GradScaler):
                        _watch_class(cls)
            except Exception:  # noqa: BLE001, S110 - never into the training loop; skips then reported
                pass

    return __init__


def _wrap(name: str, original: Any) -> Any:
    # Never traced (a step compiled with its scaler); disabled here, not at import (that loads dynamo).
    if name == "step":
        before, after = torch.compiler.disable(_tell_step), None
    else:  # unscale_: found_inf exists only after the call
        before, after = None, torch.compiler.disable(_tell_unscaled)

    @functools.wraps(original)
    def wrapper(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None and _LISTENERS:
            before(scaler, optimizer)
        out = original(scaler, optimizer, *args, **kwargs)
        if after is not None and _LISTENERS:
            after(scaler, optimizer)
        return out

    return wrapper


class ScalerWatch:
    """`listener` is told of scaler calls until `.remove()`. The first watch wraps the scaler classes'
    methods; the last one removed puts back each that is still our wrapper. One that another tool wrapped
    since stays as it is (its wrapper calls ours, which, with no listener, only calls through): restoring
    under it would drop that tool's wrapper."""

    def __init__(self, listener: ScalerListener) -> None:
        # Once the listener is collected unremoved, this watch is removed at the next `settle` (never by the
        # callback itself: it may run inside `__init__` or `remove` of another watch, on any thread).
        self.listener: weakref.ref | None = weakref.ref(listener, lambda _ref: later(self.remove))
        if not _LISTENERS:
            for cls in {c: None for name in WATCHED for c in _scaler_classes(name)}:
                _watch_class(cls)
            base = torch.amp.GradScaler
            init = base.__dict__["__init__"]
            wrapper = _wrap_init(init)
            _WRAPPED[(base, "__init__")] = (init, wrapper)
            base.__init__ = wrapper
        _LISTENERS.append(self.listener)

    def remove(self) -> None:
        listener, self.listener = self.listener, None
        if listener is None:
            return
        _LISTENERS[:] = [x for x in _LISTENERS if x is not listener]
        if _LISTENERS:
            return
        for (cls, name), (original, wrapper) in list(_WRAPPED.items()):
            if cls.__dict__.get(name) is wrapper:  # identity: functools.wraps copies any marker
                setattr(cls, name, original)
            del _WRAPPED[(cls, name)]
