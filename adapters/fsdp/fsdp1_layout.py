"""Where FSDP1 keeps each original parameter in its FlatParameter: everything private FSDP1 exposes is
read once, here (`fsdp1_unit`), when the adapter is built."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def module_order(chunks: Sequence[torch.nn.Module]) -> dict[int, int]:
    """id(module) -> its position in the chunks' module order (one walk, at setup)."""
    order: dict[int, int] = {}
    for chunk in chunks:
        for m in chunk.modules():
            order.setdefault(id(m), len(order))
    return order


@dataclass(frozen=True)
class Slot:
    """One original parameter inside an FSDP1 FlatParameter."""

    flat: torch.nn.Parameter
    owner: torch.nn.Module  # the module the original parameter belongs to
    fqn: str  # relative to the FSDP unit's wrapped module
    shape: torch.Size
    unsharded_offset: int  # in the unsharded flat gradient (alignment padding included)
    numel: int
    shard_offset: int | None  # in the local flat shard; None when this rank holds none of it
    shard_numel: int
    orig: torch.nn.Parameter | None  # the original Parameter (use_orig_params=True), else None


@dataclass
class Fsdp1Unit:
    fsdp: torch.nn.Module
    flat: torch.nn.Parameter
    slots: list[Slot]
    sharded: bool
    use_orig_params: bool
    syncs_gradients: Callable[[], bool]


def fsdp1_unit(fsdp: torch.nn.Module) -> Fsdp1Unit | None:
    """Everything the adapter reads from FSDP1's private state, in one place.

    FSDP1 has no public API for where an original parameter lives in its FlatParameter; these attributes
    are stable from torch 2.1 to 2.13. Returns None for a unit that manages no parameters.
    """
    handle = getattr(fsdp, "_handle", None)
    if handle is None:
        return None
    flat = handle.flat_param
    needed = ("_fqns", "_shapes", "_numels", "_numels_with_padding", "_is_padding_mask", "_shard_param_infos")
    missing = [a for a in needed if not hasattr(flat, a)]
    if missing or not hasattr(handle, "_use_orig_params") or not hasattr(fsdp, "_sync_gradients"):
        raise RuntimeError(
            f"trainermon: FSDP1 in torch {torch.__version__} lacks the FlatParameter layout attributes "
            f"{missing or ['_use_orig_params/_sync_gradients']}; the FSDP adapter is tested with torch 2.13"
        )
    use_orig = bool(handle._use_orig_params)
    origs = list(flat._params) if use_orig and flat._params is not None else [None] * len(flat._fqns)
    owners = [info.module for info in flat._param_infos]
    offsets: list[int] = []
    position = 0
    for numel, is_pad in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not is_pad:
            offsets.append(position)
        position += numel
    slots = []
    for i, fqn in enumerate(flat._fqns):
        info = flat._shard_param_infos[i]
        slots.append(
            Slot(
                flat=flat,
                owner=owners[i],
                fqn=fqn,
                shape=torch.Size(flat._shapes[i]),
                unsharded_offset=offsets[i],
                numel=int(flat._numels[i]),
                shard_offset=int(info.offset_in_shard) if info.in_shard else None,
                shard_numel=int(info.numel_in_shard) if info.in_shard else 0,
                orig=origs[i],
            )
        )
    return Fsdp1Unit(
        fsdp=fsdp,
        flat=flat,
        slots=slots,
        sharded=bool(handle.uses_sharded_strategy),
        use_orig_params=use_orig,
        syncs_gradients=lambda: bool(fsdp._sync_gradients),
    )
