"""The tensors of a module call that get rows, and their names, as msprobe numbers them: shared by the
eager hooks (`activations`) and the traced ones (`graph_taps`)."""

from __future__ import annotations

import copy
from typing import Any

import torch

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


def output_slots(output: Any) -> list[Any]:
    """A module's outputs as msprobe numbers them: a tuple's or list's elements by position (None
    included), a tensor alone; a dict's activation values (ours only)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return list(output)
    if isinstance(output, dict):
        return [v for v in output.values() if is_activation(v)]
    return []


def replace_tensors(obj: Any, by_id: dict[int, torch.Tensor]) -> Any:
    """`obj` (a tensor, or a tuple, list or dict of them) with the tensors whose id is in `by_id` replaced,
    in a container of its own type: a namedtuple, a `torch.return_types` tuple or an HF `ModelOutput`
    (a dict subclass read by attribute) stays what the caller expects. A container that cannot be rebuilt
    raises (the hook counts it as a fault and leaves the output as it was)."""
    if isinstance(obj, torch.Tensor):
        return by_id.get(id(obj), obj)
    kind = type(obj)
    if isinstance(obj, (tuple, list)):
        items = [by_id.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in obj]
        if kind is tuple or kind is list:
            return kind(items)
        return kind(*items) if hasattr(obj, "_fields") else kind(items)  # a namedtuple takes fields
    if isinstance(obj, dict):
        if kind is dict:
            return {k: by_id.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in obj.items()}
        new = copy.copy(obj)  # a subclass keeps its type (and ModelOutput its attributes) through setitem
        for k, v in obj.items():
            if isinstance(v, torch.Tensor) and id(v) in by_id:
                new[k] = by_id[id(v)]
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
