"""DTensor placements as trainermon placements, in one place (checked on torch 2.13).

Used by every adapter that meets DTensors: FSDP2, FSDP2 + tensor parallelism (torchtitan's
composition), HSDP, and tensor parallelism alone (`parallelize_module` with the plain torch adapter).

A DTensor lives on a device mesh; for each mesh dimension its placement says how the full tensor is
laid out over that dimension's process group:

- `Shard(d)` and `_StridedShard(d, split_factor)` (FSDP2 over an already tensor-parallel dimension):
  disjoint pieces, so partial statistics are merged over that group (`Sharded` over it). Which elements a
  strided piece holds does not matter to sums, minima and maxima, only that the pieces are disjoint.
- `Replicate()`: copies, so only coordinate 0 of that group takes part and writes (`replicated`).
- `Partial(op)`: each rank holds a summand, not a piece: statistics cannot be merged from it. The value
  is first redistributed to `Replicate` on those dimensions (one all-reduce of the tensor over that
  group, on every rank of it; no placement torch 2.13 gives parameters, gradients or optimizer states
  in the layouts tested is Partial, so this is the rare path).

Mesh dimensions of size 1 are ignored (nothing to merge or copy). The groups are listed in mesh dimension
order, the same on every rank, as the collector's merge requires.
"""

from __future__ import annotations

from typing import Any

import torch

from trainermon.collect.placement import LOCAL, Placement, Replicated, Sharded, TensorPiece
from trainermon.stats.kinds import shard_label

_DTENSOR: type | None = None


def is_dtensor(t: Any) -> bool:
    """Called per tensor read: the class is looked up once (an import statement per call cost ~1 us)."""
    global _DTENSOR
    if _DTENSOR is None:
        from torch.distributed.tensor import DTensor

        _DTENSOR = DTensor
    return type(t) is not torch.Tensor and isinstance(t, _DTENSOR)


def _is_shard(p: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return p.is_shard() or isinstance(p, _StridedShard)


def placement_of(t: Any) -> Placement:
    """The placement of a DTensor's full tensor over the process groups of its mesh. A mesh cut from a
    larger one (FSDP2 shards the parameters that tensor parallelism leaves whole on the "dp" sub-mesh
    of ("dp", "tp")) holds copies of the tensor along the dimensions it does not have."""
    mesh = t.device_mesh
    over, copies = [], []
    for dim, p in enumerate(t.placements):
        if mesh.size(dim) == 1:
            continue
        if _is_shard(p):
            over.append(mesh.get_group(dim))
        elif p.is_replicate():
            copies.append(mesh.get_group(dim))
        # Partial is redistributed away before this is asked (see `dtensor_piece`)
    copies += _dims_outside(mesh)
    if over:
        return Sharded(*over, replicated=tuple(copies))
    return Replicated(*copies) if copies else LOCAL


def _dims_outside(mesh: Any) -> list[Any]:
    """Groups of the root mesh's dimensions (size > 1) that the sub-mesh `mesh` does not have.
    `DeviceMesh._get_root_mesh` is private (torch 2.13); a mesh without it is taken as its own root."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if callable(get_root) else None
    if root is None or root is mesh or not root.mesh_dim_names or not mesh.mesh_dim_names:
        return []
    mine = set(mesh.mesh_dim_names)
    return [
        root.get_group(d)
        for d, name in enumerate(root.mesh_dim_names)
        if name not in mine and root.size(d) > 1
    ]


def without_partial(t: Any) -> Any:
    """`t` with every `Partial` mesh dimension reduced to `Replicate` (a collective over that group)."""
    if not any(p.is_partial() for p in t.placements):
        return t
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in t.placements]
    with torch.no_grad():
        return t.redistribute(t.device_mesh, placements)


def dtensor_piece(t: Any, dtype: torch.dtype | None = None) -> TensorPiece:
    """This rank's piece of a DTensor, placed over its mesh, with the full tensor's shape. A rank that
    holds no element (an uneven split) keeps its row with no tensor, so the merge lines up."""
    t = without_partial(t)
    with torch.no_grad():
        local = t.to_local()
    placement = placement_of(t)
    if isinstance(placement, Sharded) and local.numel() == 0:
        local = None
    return TensorPiece(local, placement, tuple(t.shape), dtype or t.dtype)


def local_piece(t: Any) -> TensorPiece:
    """This rank's own values of a DTensor as a `Local` row, labelled with the piece it is."""
    t = without_partial(t)
    with torch.no_grad():
        local = t.to_local()
    return TensorPiece(
        local, LOCAL, tuple(local.shape), local.dtype, shard_label(t.placements, t.device_mesh)
    )


def splits_over_ranks(params: list[Any]) -> bool:
    """Some DTensor parameter is sharded: no single rank writes every row of the model."""
    return any(is_dtensor(p) and isinstance(placement_of(p), Sharded) for p in params)
