"""Shard labels of module inputs and outputs that torch's tensor-parallel styles hand on as this rank's
plain piece.

`parallelize_module` turns a style's sharded DTensor output back into a local tensor (`use_local_output`)
in a forward hook that runs before any of ours, so our hook sees a plain tensor that is one piece of a
larger one; `PrepareModuleInput(use_local_output=True)` does the same to inputs in a forward pre-hook.
The style survives only in the closures of the hooks `distribute_module` and the styles' `_apply`
register; these functions read them once per hooked module (checked on torch 2.11 and 2.13) and return
() when a hook looks otherwise, so an unknown style gives unlabelled rows, never an error:

- `ColwiseParallel` / `RowwiseParallel`: output hook over `output_fn = partial(_prepare_output_fn,
  output_layouts, use_local_output)` and `device_mesh`.
- `SequenceParallel(use_local_output=True)`: output hook over `partial(_prepare_output_fn,
  use_local_output)`; the layout (`Shard(sequence_dim)`) is in its input hook's `partial(_prepare_input_fn,
  sequence_sharding)`.
- `PrepareModuleOutput` (and `PrepareModuleInputOutput`, which applies one): output hook over the style
  (`self`) and `device_mesh`; one layout per output, by position.
- `PrepareModuleInput` (and `PrepareModuleInputOutput`): input hook over the style and `device_mesh`; one
  layout per positional argument. Inputs are labelled by tensor argument, so only the arguments before the
  first one the style leaves alone (layout None, which may be a non-tensor) are known to be tensors and
  get a label; keyword arguments get none.

transformers' own tensor parallelism (`from_pretrained(tp_plan=...)`, checked on 5.24) registers no hooks:
its style replaces `module.forward` by a `tp_forward` closure over the style (`self`) and `mesh` that
converts inside forward, so our hooks see the caller's input and the style's output. Its
`ColwiseParallel`, `RowwiseParallel` and `SequenceParallel` are read (their `input_layouts`,
`output_layouts`, `Shard(sequence_dim)`); other transformers styles give unlabelled rows.
"""

from __future__ import annotations

from typing import Any

import torch

from trainermon.stats.kinds import shard_label


def _free_vars(hook: Any) -> dict[str, Any]:
    code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None) or ()
    try:
        return dict(zip(code.co_freevars, (cell.cell_contents for cell in cells))) if code else {}
    except ValueError:  # an empty cell
        return {}


def _partial_of(fn: Any, name: str) -> tuple:
    """The bound arguments of `partial(<style>.name, ...)` (subclasses' overrides included); () otherwise."""
    return getattr(fn, "args", ()) if getattr(getattr(fn, "func", None), "__name__", "") == name else ()


def _is_style(obj: Any, name: str) -> bool:
    """`obj` is an instance of torch's style `name` (a subclass too), looked up by name so that modules
    hooked without tensor parallelism never import it."""
    return any(c.__name__ == name and c.__module__.startswith("torch.") for c in type(obj).__mro__)


def _piece(layout: Any, mesh: Any) -> str:
    """The label of a local piece laid out as `layout` on a 1-D mesh; "" for a whole tensor."""
    from .dtensor import _is_shard

    if layout is None or mesh is None or getattr(mesh, "ndim", None) != 1 or not _is_shard(layout):
        return ""
    return shard_label((layout,), mesh)


def _sequence_sharding(module: torch.nn.Module) -> Any:
    for hook in getattr(module, "_forward_pre_hooks", {}).values():
        args = _partial_of(_free_vars(hook).get("input_fn"), "_prepare_input_fn")
        if len(args) == 1 and isinstance(args[0], tuple) and len(args[0]) == 1:  # SequenceParallel's
            return args[0][0]
    return None


def _labels(module: torch.nn.Module, hook: Any) -> tuple[str, ...]:
    free = _free_vars(hook)
    mesh, style = free.get("device_mesh"), free.get("self")
    args = _partial_of(free.get("output_fn"), "_prepare_output_fn")
    if len(args) == 2 and args[1] is True and isinstance(args[0], tuple) and len(args[0]) == 1:
        return (_piece(args[0][0], mesh),)  # ColwiseParallel, RowwiseParallel
    if args == (True,):  # SequenceParallel(use_local_output=True)
        return (_piece(_sequence_sharding(module), mesh),)
    if _is_style(style, "PrepareModuleOutput") and style.use_local_output is True:
        layouts = zip(style.output_layouts, style.desired_output_layouts)
        return tuple(_piece(desired, mesh) if given is not None else "" for given, desired in layouts)
    return ()


def _transformers_label(module: torch.nn.Module, which: str) -> tuple[str, ...]:
    """The label of the first input (`which="input"`) or the output of a module under transformers' own
    tensor parallelism; () when `module.forward` is not its `tp_forward` or the style is not read."""
    forward = module.__dict__.get("forward")
    if getattr(forward, "__name__", "") != "tp_forward":
        return ()
    free = _free_vars(forward)
    style, mesh = free.get("self"), free.get("mesh")
    kinds = {c.__name__ for c in type(style).__mro__ if c.__module__.startswith("transformers.")}
    if which == "output" and getattr(style, "use_local_output", None) is not True:
        return ()  # the output stays a DTensor, which labels itself
    if kinds & {"ColwiseParallel", "RowwiseParallel"}:
        layout = getattr(style, f"{which}_layouts", None)
    elif "SequenceParallel" in kinds and isinstance(getattr(style, "sequence_dim", None), int):
        from torch.distributed.tensor import Shard

        layout = Shard(style.sequence_dim)
    else:
        return ()
    label = _piece(layout, mesh) if not isinstance(layout, tuple) else ""
    return (label,) if label else ()


def local_output_shards(module: torch.nn.Module) -> tuple[str, ...]:
    """Per output position, the label of the piece a style hands on (`Shard(1)[tp=0/2]`), or "" for a
    whole tensor or an output no style touched; () when no style's hook is found. No collective."""
    for hook in getattr(module, "_forward_hooks", {}).values():
        labels = _labels(module, hook)
        if any(labels):
            return labels
    return _transformers_label(module, "output")


def local_input_shards(module: torch.nn.Module) -> tuple[str, ...]:
    """Per tensor argument, the label of the piece `PrepareModuleInput(use_local_output=True)` hands on,
    or ""; () when no such style's hook is found. No collective."""
    for hook in getattr(module, "_forward_pre_hooks", {}).values():
        free = _free_vars(hook)
        style, mesh = free.get("self"), free.get("device_mesh")
        if not _is_style(style, "PrepareModuleInput") or style.use_local_output is not True:
            continue
        labels = []
        for given, desired in zip(style.input_layouts or (), style.desired_input_layouts or ()):
            if given is None:
                break
            labels.append(_piece(desired, mesh))
        if any(labels):
            return tuple(labels)
    return _transformers_label(module, "input")
