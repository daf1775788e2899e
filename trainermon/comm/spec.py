"""The collectives `cc_distribution` watches and how each one's arguments are read: which tensors are its
inputs and outputs, its process group, its reduction, its source, and which invariant it promises.

Arguments are read by position or keyword from the wrapper's own (args, kwargs), never through
`inspect.signature` (a bind per call costs more than the rest of the wrapper)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Args = tuple
Kwargs = dict


def arg(args: Args, kwargs: Kwargs, index: int, name: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


@dataclass(frozen=True)
class OpSpec:
    """One watched function. `config` is its name in `cc_distribution.ops`; `check` the invariant:
    "reduce" (all_reduce), "broadcast", "gather" (all_gather), "scatter" (reduce_scatter) or None."""

    name: str
    module: str  # "dist" (torch.distributed) or "funcol" (torch.distributed._functional_collectives)
    attr: str
    config: str
    inputs: Callable[[Args, Kwargs], list[torch.Tensor]]
    outputs: Callable[[Args, Kwargs], list[torch.Tensor]]  # tensors filled by the call (before it runs)
    group: Callable[[Args, Kwargs], Any]
    redop: Callable[[Args, Kwargs], Any] = lambda a, k: None
    src: Callable[[Args, Kwargs], Any] = lambda a, k: None
    check: str | None = None
    count_only: bool = False
    functional: bool = False  # the output is the returned (async) tensor


def _at(index: int, name: str) -> Callable[[Args, Kwargs], list[torch.Tensor]]:
    return lambda a, k: _tensors(arg(a, k, index, name))


def _value(index: int, name: str, default: Any = None) -> Callable[[Args, Kwargs], Any]:
    return lambda a, k: arg(a, k, index, name, default)


def _none(a: Args, k: Kwargs) -> list[torch.Tensor]:
    return []


def _dist_specs() -> list[OpSpec]:
    sum_ = "sum"
    specs = [
        OpSpec(
            "all_reduce",
            "dist",
            "all_reduce",
            "all_reduce",
            _at(0, "tensor"),
            _at(0, "tensor"),
            _value(2, "group"),
            _value(1, "op", sum_),
            check="reduce",
        ),
        OpSpec(
            "reduce",
            "dist",
            "reduce",
            "reduce",
            _at(0, "tensor"),
            _at(0, "tensor"),
            _value(3, "group"),
            _value(2, "op", sum_),
            src=_value(1, "dst"),
        ),
        OpSpec(
            "broadcast",
            "dist",
            "broadcast",
            "broadcast",
            _at(0, "tensor"),
            _at(0, "tensor"),
            _value(2, "group"),
            src=_value(1, "src"),
            check="broadcast",
        ),
        OpSpec(
            "all_gather",
            "dist",
            "all_gather",
            "all_gather",
            _at(1, "tensor"),
            _at(0, "tensor_list"),
            _value(2, "group"),
            check="gather",
        ),
        OpSpec(
            "reduce_scatter",
            "dist",
            "reduce_scatter",
            "reduce_scatter",
            _at(1, "input_list"),
            _at(0, "output"),
            _value(3, "group"),
            _value(2, "op", sum_),
            check="scatter",
        ),
        OpSpec(
            "all_to_all",
            "dist",
            "all_to_all",
            "all_to_all",
            _at(1, "input_tensor_list"),
            _at(0, "output_tensor_list"),
            _value(2, "group"),
        ),
        OpSpec(
            "all_to_all_single",
            "dist",
            "all_to_all_single",
            "all_to_all_single",
            _at(1, "input"),
            _at(0, "output"),
            _value(4, "group"),
        ),
        OpSpec("send", "dist", "send", "send", _at(0, "tensor"), _none, _value(2, "group")),
        OpSpec("isend", "dist", "isend", "isend", _at(0, "tensor"), _none, _value(2, "group")),
        OpSpec("recv", "dist", "recv", "recv", _none, _at(0, "tensor"), _value(2, "group")),
        OpSpec("irecv", "dist", "irecv", "irecv", _none, _at(0, "tensor"), _value(2, "group")),
        OpSpec("barrier", "dist", "barrier", "barrier", _none, _none, _value(0, "group"), count_only=True),
    ]
    for attr, config in (
        ("all_gather_into_tensor", "all_gather_into_tensor"),
        ("_all_gather_base", "all_gather_into_tensor"),
        ("all_gather_single", "all_gather_into_tensor"),
    ):
        specs.append(
            OpSpec(
                attr.lstrip("_"),
                "dist",
                attr,
                config,
                _at(1, "input_tensor"),
                _at(0, "output_tensor"),
                _value(2, "group"),
                check="gather",
            )
        )
    for attr, config in (
        ("reduce_scatter_tensor", "reduce_scatter_tensor"),
        ("_reduce_scatter_base", "reduce_scatter_tensor"),
        ("reduce_scatter_single", "reduce_scatter_tensor"),
    ):
        specs.append(
            OpSpec(
                attr.lstrip("_"),
                "dist",
                attr,
                config,
                _at(1, "input"),
                _at(0, "output"),
                _value(3, "group"),
                _value(2, "op", sum_),
                check="scatter",
            )
        )
    return specs


def _funcol_specs() -> list[OpSpec]:
    one = _at(0, "self")
    extra = [
        OpSpec("funcol.all_gather_single", "funcol", "all_gather_single", "funcol", one, _none,
               _value(2, "group"), check="gather", functional=True),
        OpSpec("funcol.reduce_scatter_single", "funcol", "reduce_scatter_single", "funcol", one, _none,
               _value(3, "group"), _value(1, "reduceOp"), check="scatter", functional=True),
    ]  # fmt: skip
    return extra + [
        OpSpec(
            "funcol.all_reduce",
            "funcol",
            "all_reduce",
            "funcol",
            one,
            _none,
            _value(2, "group"),
            _value(1, "reduceOp"),
            check="reduce",
            functional=True,
        ),
        OpSpec(
            "funcol.all_gather_tensor",
            "funcol",
            "all_gather_tensor",
            "funcol",
            one,
            _none,
            _value(2, "group"),
            check="gather",
            functional=True,
        ),
        OpSpec(
            "funcol.reduce_scatter_tensor",
            "funcol",
            "reduce_scatter_tensor",
            "funcol",
            one,
            _none,
            _value(3, "group"),
            _value(1, "reduceOp"),
            check="scatter",
            functional=True,
        ),
        OpSpec(
            "funcol.all_to_all_single",
            "funcol",
            "all_to_all_single",
            "funcol",
            one,
            _none,
            _value(3, "group"),
            functional=True,
        ),
        OpSpec(
            "funcol.broadcast",
            "funcol",
            "broadcast",
            "funcol",
            one,
            _none,
            _value(2, "group"),
            src=_value(1, "src"),
            check="broadcast",
            functional=True,
        ),
    ]


#: batch_isend_irecv is special (a list of P2POp): see `patch`.
BATCH_P2P = "batch_isend_irecv"


def all_specs() -> list[OpSpec]:
    return _dist_specs() + _funcol_specs()


_REDOPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "PREMUL_SUM", "BAND", "BOR", "BXOR")


def redop_name(op: Any) -> str:
    """'sum', 'avg', 'max', ... for a ReduceOp or a functional collective's string."""
    if op is None:
        return "sum"
    if isinstance(op, str):
        return op.lower()
    import torch.distributed as dist

    for name in _REDOPS:
        candidate = getattr(dist.ReduceOp, name, None)
        try:
            if candidate is not None and op == candidate:
                return name.lower()
        except (TypeError, RuntimeError):
            continue
    return str(op).rsplit(".", 1)[-1].lower()
