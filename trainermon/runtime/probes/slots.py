"""The tensors of a module call that get rows, and their names, as msprobe numbers them: shared by the
eager hooks (`activations`) and the traced ones (`graph_taps`)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import types
from typing import Any

import torch

logger = logging.getLogger("trainermon")

#: What a traced hook (`graph_taps`) returns when it cannot tap this call: the installed hook then runs
#: the eager body outside the graph (a graph break). Tensor subclasses other than DTensor (whose local
#: pieces the operators' rule reads, see `tap_ops`): the operators could not read them.
UNTAPPED = object()


def is_activation(t: Any) -> bool:
    """Activations are floating point, complex or quantized tensors (the engine reads or refuses them,
    never silently); integer tensors (token ids, masks) are not activations."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex() or t.is_quantized)


def no_values(t: torch.Tensor) -> bool:
    """A nested or meta tensor: no values to read, and no `view_as` to hook its gradient through (the
    engine refuses its rows, counted and told). Two attribute reads."""
    return t.is_nested or t.is_meta


def activations_in(obj: Any) -> list[torch.Tensor]:
    """Top-level activation tensors of a module's inputs or outputs (tensor, tuple/list, dict values)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if is_activation(obj) else []
    if isinstance(obj, (tuple, list)):
        return [t for t in obj if is_activation(t)]
    if isinstance(obj, dict):
        return [t for t in obj.values() if is_activation(t)]
    return []


def io_names(base: str, count: int) -> list[str]:
    return [base] if count == 1 else [f"{base}_{i}" for i in range(count)]


def input_slots(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """A module's tensor arguments, positional then keyword: what msprobe numbers as inputs."""
    return [a for a in args if isinstance(a, torch.Tensor)] + [
        v for v in kwargs.values() if isinstance(v, torch.Tensor)
    ]


#: A nested container's place among a tuple's or list's outputs: numbered, no row (an integer tensor, as
#: token ids are), where msprobe writes a NaN row; its tensors are numbered after the top-level elements.
HOLDER = torch.empty(0, dtype=torch.long, device="meta")
_CONTAINERS = (tuple, list, dict)
_LEAVES = (torch.Tensor, type(None))  # tested first: `dataclasses.is_dataclass` costs ~0.5 us a call
_said_types: set[str] = set()
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType)


def output_slots(output: Any) -> list[Any]:
    """A module's outputs as msprobe numbers them: a tuple's or list's elements by position (None
    included), a tensor alone. Ours only: a dict's (or dataclass's) tensor values in order, integer ones
    numbered without a row, nested containers numbered as in a tuple (other values, None, skipped); the
    tensors inside nested tuples, lists, dicts or dataclasses, depth first, numbered after the top-level
    elements (a nested element keeps its number as `HOLDER`). A flat tuple of tensors (or None) costs two
    isinstance tests per element; nesting is walked only where present."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        slots = list(output)
        nested = [i for i, t in enumerate(slots) if not isinstance(t, _LEAVES) and _is_container(t)]
        if not nested:
            return slots
        inner: list[torch.Tensor] = []
        for i in nested:
            _tensors_in(slots[i], inner)
            slots[i] = HOLDER
        return slots + inner
    if isinstance(output, dict) or _is_dataclass(output):
        values = output.values() if isinstance(output, dict) else _fields(output)
        slots, inner = [], []
        for v in values:
            if isinstance(v, torch.Tensor):
                slots.append(v)
            elif not isinstance(v, _LEAVES) and _is_container(v):  # numbered as in a tuple
                slots.append(HOLDER)
                _tensors_in(v, inner)
        return slots + inner
    if output is not None and not isinstance(output, _FUNCTIONS):  # Megatron's IdentityFuncOp returns one
        _say_unread(type(output).__qualname__)
    return []


def _is_container(obj: Any) -> bool:
    return isinstance(obj, _CONTAINERS) or _is_dataclass(obj)


def _is_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _fields(obj: Any) -> list[Any]:
    return [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]


def _tensors_in(obj: Any, into: list[torch.Tensor], depth: int = 0) -> None:
    """The tensors inside a nested container, depth first (other values skipped; 8 levels at most)."""
    if isinstance(obj, torch.Tensor):
        into.append(obj)
    elif depth < 8:
        if isinstance(obj, (tuple, list)):
            items: Any = obj
        elif isinstance(obj, dict):
            items = obj.values()
        elif _is_dataclass(obj):
            items = _fields(obj)
        else:
            return
        for item in items:
            _tensors_in(item, into, depth + 1)


@torch.compiler.assume_constant_result  # run as plain Python while dynamo traces: no logging in the graph
def _say_unread(kind: str) -> bool:
    if kind not in _said_types:  # once per type: the hooks see no module name here
        _said_types.add(kind)
        logger.warning(
            "trainermon: a module returned a %s (not a tensor, tuple, list, dict or dataclass): its outputs "
            "get no actv or actv_grad rows",
            kind,
        )
    return True


def replace_slots(output: Any, new: dict[int, torch.Tensor]) -> Any:
    """`output` (a tensor, or a plain tuple, list or dict) with the slots numbered as `output_slots`
    numbers them whose number is in `new` replaced, nested ones included: by position, not by id (dynamo
    traces it in the graph taps). Walks the output once; for the rare call that returns a parameter."""
    if isinstance(output, torch.Tensor):
        return new.get(0, output)
    count = [0]
    if isinstance(output, (tuple, list)):
        items = list(output)
        nested = [i for i, t in enumerate(items) if not isinstance(t, _LEAVES) and _is_container(t)]
        for i in range(len(items)):
            if i in new and i not in nested:
                items[i] = new[i]
        count[0] = len(items)
        for i in nested:
            items[i] = _replace_inner(items[i], new, count, 0)
        return type(output)(items)
    rebuilt = dict(output)
    inner = []
    for k, v in output.items():
        if isinstance(v, torch.Tensor):
            rebuilt[k] = new.get(count[0], v)
            count[0] += 1
        elif not isinstance(v, _LEAVES) and _is_container(v):  # its `HOLDER` slot
            inner.append(k)
            count[0] += 1
    for k in inner:
        rebuilt[k] = _replace_inner(output[k], new, count, 0)
    return rebuilt


def _replace_inner(obj: Any, new: dict[int, torch.Tensor], count: list[int], depth: int) -> Any:
    """`_tensors_in`'s walk, numbering from `count[0]`, with the numbers in `new` replaced. Whether a
    container changed is told by the numbers it spans, not by identity (dynamo cannot trace `is` between
    tuples, which fullgraph refuses)."""
    if isinstance(obj, torch.Tensor):
        count[0] += 1
        return new.get(count[0] - 1, obj)
    if depth >= 8:
        return obj
    start = count[0]
    if isinstance(obj, (tuple, list)):
        items = [_replace_inner(t, new, count, depth + 1) for t in obj]
        if not _touched(new, start, count[0]):
            return obj
        kind = type(obj)
        if kind is tuple or kind is list:
            return kind(items)
        return kind(*items) if hasattr(obj, "_fields") else kind(items)
    if isinstance(obj, dict):
        got = {k: _replace_inner(v, new, count, depth + 1) for k, v in obj.items()}
        if not _touched(new, start, count[0]):
            return obj
        if type(obj) is dict:
            return got
        rebuilt = copy.copy(obj)  # a subclass (ModelOutput) keeps its type through setitem
        for k, v in got.items():
            rebuilt[k] = v
        return rebuilt
    if _is_dataclass(obj):
        rebuilt = copy.copy(obj)
        for f in dataclasses.fields(obj):
            first = count[0]
            got = _replace_inner(getattr(obj, f.name, None), new, count, depth + 1)
            if _touched(new, first, count[0]):
                object.__setattr__(rebuilt, f.name, got)  # a frozen dataclass too
        return rebuilt
    return obj


def _touched(new: dict[int, torch.Tensor], start: int, end: int) -> bool:
    return any(i in new for i in range(start, end))


def replace_tensors(obj: Any, by_id: dict[int, torch.Tensor]) -> Any:
    """`obj` (a tensor, or a tuple, list, dict or dataclass of them, nested or not) with the tensors whose
    id is in `by_id` replaced, in a container of its own type: a namedtuple, a `torch.return_types` tuple
    or an HF `ModelOutput` (a dict subclass read by attribute) stays what the caller expects. A container
    that cannot be rebuilt raises (the hook counts it as a fault and leaves the output as it was)."""
    if isinstance(obj, torch.Tensor):
        return by_id.get(id(obj), obj)
    kind = type(obj)
    if isinstance(obj, (tuple, list)):
        items = [replace_tensors(t, by_id) for t in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj  # nothing replaced in it (a nested container stays the object it was)
        if kind is tuple or kind is list:
            return kind(items)
        return kind(*items) if hasattr(obj, "_fields") else kind(items)  # a namedtuple takes fields
    if isinstance(obj, dict):
        if kind is dict:
            new_dict = {k: replace_tensors(v, by_id) for k, v in obj.items()}
            return obj if all(new_dict[k] is v for k, v in obj.items()) else new_dict
        new = copy.copy(obj)  # a subclass keeps its type (and ModelOutput its attributes) through setitem
        for k, v in obj.items():
            got = replace_tensors(v, by_id)
            if got is not v:
                new[k] = got
        return new
    if _is_dataclass(obj):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name, None)
            got = replace_tensors(v, by_id)
            if got is not v:
                object.__setattr__(new, f.name, got)  # a frozen dataclass too
        return new
    return obj


class Names:
    """`io_names(base, count)` kept per count: a hook names its slots on every call. A module's calls
    almost always have one count: it is kept in two slots, others (rare) in a dict made when first seen
    (a dict per instance cost ~0.16 KB, 0.13 MB for the 836 of a 418-module model)."""

    __slots__ = ("base", "count", "names", "others")

    def __init__(self, base: str) -> None:
        self.base = base
        self.count = -1
        self.names: list[str] = []
        self.others: dict[int, list[str]] | None = None

    def __call__(self, count: int) -> list[str]:
        if count == self.count:
            return self.names
        if self.count < 0:
            self.count, self.names = count, io_names(self.base, count)
            return self.names
        if self.others is None:
            self.others = {}
        names = self.others.get(count)
        if names is None:
            names = self.others[count] = io_names(self.base, count)
        return names


_BLANK: list[tuple[str, ...]] = [("",) * n for n in range(9)]


def padded(pieces: tuple[str, ...], count: int) -> tuple[str, ...]:
    """`count` piece labels: `pieces`, then "" (no labels at all, the common case: a shared tuple)."""
    if not pieces and count < len(_BLANK):
        return _BLANK[count]
    return tuple(pieces[i] if i < len(pieces) else "" for i in range(count))
