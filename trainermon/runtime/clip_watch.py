"""Gradient clipping, seen before it scales the gradients in place.

A plain torch loop (and HF Trainer, Accelerate, Lightning, torchtitan, FSDP) clips between backward and
`optimizer.step()`. Read at the optimizer's pre-step, the gradients, and the global grad norm summed from
them, would be the clipped ones: min(norm, max_norm), a capped series on which no spike shows. So on
steps that collect gradients the monitor wraps the functions that clip in place and reads the step's
gradients when the first of them is called (`StepLoop.on_grads_final`); the optimizer's pre-step then
reads nothing again.

Watched (`TORCH_CLIP_ENTRIES`): `torch.nn.utils.clip_grad._clip_grads_with_norm_`, which
`clip_grad_norm_` calls through its module's globals (so a `clip_grad_norm_` imported by name before the
monitor is seen too); its public alias `torch.nn.utils.clip_grads_with_norm_` (torchtitan's clipping);
`clip_grad_value_` in both modules. An adapter adds its framework's own clipping (FSDP1's
`FullyShardedDataParallel.clip_grad_norm_`). A name imported before the wrapper exists (`from
torch.nn.utils import clip_grad_value_`) keeps the original: the rows are then read at the pre-step.

The wrappers exist only while some monitor's collected step reads gradients (`watch` / `Watch.remove`),
like the collective wrappers of `trainermon.comm.patch`: steps that collect nothing call torch's own
functions. A wrapper costs one Python call and, with its listeners, a set lookup per clipped parameter.
Listeners are held weakly: a monitor dropped without `close()` is not kept alive by the wrappers; once
collected, its watch is removed as by `Watch.remove` at the next set_monitor or close.
A clipping that torch.compile traces calls the original (no graph break, so `fullgraph=True` stays
valid, and no recompilation after the monitor is gone): its gradients are read at the pre-step.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .lifecycle import later


class Listener(Protocol):
    def before_clipping(self, params: list | None, owner: Any) -> None:
        """`params`: the clipped parameters as a list (None for a method entry); `owner`: the model a
        method entry was called on (None for a function entry). Never raises."""

    def after_clipping(self) -> None:
        """The clipping returned (or raised). Never raises."""


@dataclass(frozen=True)
class ClipEntry:
    """A function that scales gradients in place: `owner.<name>` (a module's function, or a class's method
    whose first argument is the model, not the parameters)."""

    owner: Any
    name: str
    method: bool = False


def torch_clip_entries() -> tuple[ClipEntry, ...]:
    """torch's in-place clipping functions (see the module docstring)."""
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    return (
        ClipEntry(clip_grad, "_clip_grads_with_norm_"),
        ClipEntry(utils, "clip_grads_with_norm_"),
        ClipEntry(clip_grad, "clip_grad_value_"),
        ClipEntry(utils, "clip_grad_value_"),
    )


class _Installed:
    """One entry's wrapper and the original it replaced; the listeners are shared by every entry."""

    def __init__(self, entry: ClipEntry, original: Any, wrapper: Any) -> None:
        self.entry, self.original, self.wrapper = entry, original, wrapper


_listeners: list[weakref.ref] = []  # weak references to the listeners
_installed: dict[tuple[int, str], _Installed] = {}
_users: dict[tuple[int, str], int] = {}


class Watch:
    """A listener's hold on its entries: `remove()` drops the listener and puts each original back once no
    other listener holds it (unless something else has replaced the wrapper since)."""

    def __init__(self, listener: Listener, keys: list[tuple[int, str]]) -> None:
        # Once the listener is collected unremoved, this watch is removed at the next `settle` (never by the
        # callback itself: it may run inside `watch` or a wrapper, between a check and its update).
        self.listener, self.keys = weakref.ref(listener, lambda _ref: later(self.remove)), keys

    def remove(self) -> None:
        _listeners[:] = [ref for ref in _listeners if ref is not self.listener]  # identity, not ==
        for key in self.keys:
            _users[key] -= 1
            if _users[key] == 0:
                del _users[key]
                done = _installed.pop(key)
                owner, name = done.entry.owner, done.entry.name
                if owner.__dict__.get(name) is done.wrapper:
                    setattr(owner, name, done.original)
        self.keys = []


def watch(listener: Listener, entries: tuple[ClipEntry, ...]) -> Watch:
    """Call `listener` before each call of the entries' functions, until `remove()`. Entries missing from
    this torch (renamed) are skipped."""
    keys: list[tuple[int, str]] = []
    for entry in entries:
        key = (id(entry.owner), entry.name)
        if key in keys:
            continue
        if key not in _installed:
            original = entry.owner.__dict__.get(entry.name)
            if not callable(original):
                continue
            wrapper = _wrap(original, entry)
            setattr(entry.owner, entry.name, wrapper)
            _installed[key] = _Installed(entry, original, wrapper)
        _users[key] = _users.get(key, 0) + 1
        keys.append(key)
    handle = Watch(listener, keys)
    _listeners.append(handle.listener)
    return handle


def _wrap(original: Any, entry: ClipEntry) -> Any:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _listeners or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        if entry.method:
            params, owner = None, args[0] if args else None
        else:
            args, kwargs, params = _listed(args, kwargs)
            owner = None
        listeners = [x for ref in _listeners if (x := ref()) is not None]
        for listener in listeners:
            listener.before_clipping(params, owner)
        try:
            return original(*args, **kwargs)
        finally:
            for listener in listeners:
                listener.after_clipping()

    return wrapper


def _listed(args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
    """The call's `parameters` (first argument) as a list, passed on as that list: a generator would be
    spent by the listeners before torch saw it (torch makes it a list the same way)."""
    if args:
        params = args[0]
        listed = [params] if isinstance(params, torch.Tensor) else list(params)
        return (listed, *args[1:]), kwargs, listed
    params = kwargs.get("parameters")
    if params is None:
        return args, kwargs, []
    listed = [params] if isinstance(params, torch.Tensor) else list(params)
    return args, {**kwargs, "parameters": listed}, listed
