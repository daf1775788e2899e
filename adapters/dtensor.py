"""DTensor placements as trainermon placements, in one place (checked on torch 2.13).

Used by every adapter that meets DTensors: FSDP2, FSDP2 + tensor parallelism (torchtitan's
composition), HSDP, and tensor parallelism alone (`parallelize_module` with the plain torch adapter).

A DTensor lives on a device mesh; for each mesh dimension its placement says how the full tensor is
laid out over that dimension's process group:

- `Shard(d)` and `_StridedShard(d, split_factor)` (FSDP2 over an already tensor-parallel dimension):
  disjoint pieces, so partial statistics are merged over that group (`Sharded` over it). Which elements a
  strided piece holds does not matter to sums, minima and maxima, only that the pieces are disjoint.
- `Replicate()`: copies, so only coordinate 0 of that group takes part and writes (`replicated`).
- `Partial(op)`: each rank holds a summand, not a piece: statistics cannot be merged from it. Sequence
  parallelism leaves the gradients of the norms' weights Partial over the TP group until the optimizer
  step. For the rows of the full tensor, the adapters reduce a step's Partial tensors
  together: one all-reduce per (mesh dimension, dtype) of their packed local values, not one per tensor
  (a 32-layer model under sequence parallelism has ~65 such gradients). A rank's own values
  (`local_piece`, the unreduced gradient) are its summand, labelled `Partial(sum)[tp=i/n]`, with no
  collective.

Mesh dimensions of size 1 are ignored (nothing to merge or copy). The groups are listed in mesh dimension
order, the same on every rank, as the collector's merge requires. A mesh cut from a larger one, or
flattened from some of its dimensions (torchtitan's "dp_shard_cp"), holds copies of the tensor along the
root mesh's dimensions on which all its ranks share one coordinate (`_dims_outside`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

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


_OUTSIDE: dict[int, tuple[Any, list[Any]]] = {}  # id(mesh) -> (mesh, its groups outside): asked per tensor
_STAGES: list[Any] = [None]  # the job's pipelining.StageMap, where ranks hold different stages


def use_stage_map(stages: Any) -> None:
    """Where ranks hold different pipeline stages (`pipelining.stage_map`), a root mesh dimension along
    which they differ ("pp") holds other tensors, not copies. Set by the adapters at `set_monitor`."""
    _STAGES[0] = stages if stages is not None and stages.splits() else None
    _OUTSIDE.clear()


def _dims_outside(mesh: Any) -> list[Any]:
    """Groups of the root mesh's dimensions (size > 1) along which every rank of `mesh` has the same
    coordinate: `mesh` is one slice of them, and its tensors are copies over them, unless the ranks along
    such a dimension hold other pipeline stages (`use_stage_map`). Decided by the ranks, not the names: a
    flattened mesh ("dp_shard_cp" of "dp_shard" x "cp") spans dimensions it does not name.
    `DeviceMesh._get_root_mesh` is private (torch 2.13); a mesh without it is taken as its own root."""
    cached = _OUTSIDE.get(id(mesh))
    if cached is not None and cached[0] is mesh:
        return cached[1]
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if callable(get_root) else None
    groups = []
    if root is not None and root is not mesh:
        coords = torch.isin(root.mesh, mesh.mesh.flatten()).nonzero()  # root coordinates of mesh's ranks
        groups = [
            root.get_group(d)
            for d in range(root.ndim)
            if root.size(d) > 1 and bool((coords[:, d] == coords[0, d]).all()) and _same_stage(root, d)
        ]
    _OUTSIDE[id(mesh)] = (mesh, groups)
    return groups


def _same_stage(root: Any, dim: int) -> bool:
    """The ranks along `dim` through this rank hold this rank's pipeline stage (always, without stages)."""
    stages = _STAGES[0]
    if stages is None:
        return True
    coordinate = root.get_coordinate()
    if coordinate is None:
        return True
    index = tuple(slice(None) if d == dim else c for d, c in enumerate(coordinate))
    return stages.same_stage(root.mesh[index].tolist())


def stage_lines(mesh: Any, world: int | None = None) -> list[tuple[Any, list[int]]]:
    """For each of `mesh`'s root dimensions of size > 1: its group and the global ranks along it through
    this rank (none where this rank is off the mesh), checked to be below `world`. What `copies_among`
    needs, found before the ranks compare their stages: an error here can then reach every rank."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = (get_root() if callable(get_root) else None) or mesh
    coordinate = root.get_coordinate()
    lines = []
    for d in range(root.ndim):
        if root.size(d) == 1:
            continue
        ranks = []
        if coordinate is not None:
            ranks = root.mesh[tuple(slice(None) if i == d else c for i, c in enumerate(coordinate))].tolist()
        if world is not None and not all(0 <= r < world for r in ranks):
            raise ValueError(f"mesh dimension {d} holds ranks {ranks} outside the world of {world}")
        lines.append((root.get_group(d), ranks))
    return lines


def copies_among(lines: Sequence[tuple[Any, list[int]]], stages: Any) -> Placement:
    """Where a plain tensor that every rank of a tensor-parallel model computes alike (a parameter left
    whole beside DTensor ones) is a copy: over the groups of the mesh's root dimensions (`stage_lines`)
    along which the ranks hold this rank's pipeline stage (`stages`, a `pipelining.StageMap`); over every
    rank without stages. No call that can fail on one rank alone."""
    if stages is None or not stages.splits():
        return Replicated(None)
    groups = [group for group, ranks in lines if stages.same_stage(ranks)]
    return Replicated(*groups) if groups else LOCAL


def without_partial(t: Any) -> Any:
    """`t` with every `Partial` mesh dimension reduced to `Replicate` (a collective over that group, for
    this tensor alone: `reduce_partials` packs a step's Partial tensors into one)."""
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
    """This rank's own values of a DTensor as a `Local` row, labelled with the piece it is (a Partial
    tensor's summand: `Partial(sum)[tp=0/2]`). No collective."""
    with torch.no_grad():
        local = t.to_local()
    return TensorPiece(
        local, LOCAL, tuple(local.shape), local.dtype, shard_label(t.placements, t.device_mesh)
    )


def reduce_partials(values: Sequence[Any]) -> list[Any]:
    """`values` with each DTensor that is `Partial(sum)` or `Partial(avg)` on some mesh dimensions made
    `Replicate` there. Cost: one all-reduce per (mesh dimension, dtype) over the packed local values of
    the tensors Partial on it (a copy of them in, one out), run in the same order on every rank, which
    holds when every rank reads the same tensors, as the adapters do. Other reduce ops (max, min) are
    redistributed one by one."""
    out = list(values)
    buckets: dict[tuple, list[int]] = {}
    for i, v in enumerate(out):
        if v is None or not is_dtensor(v) or not any(p.is_partial() for p in v.placements):
            continue
        dims = tuple((d, p.reduce_op) for d, p in enumerate(v.placements) if p.is_partial())
        if all(op in ("sum", "avg") for _, op in dims):
            buckets.setdefault((id(v.device_mesh), dims, v.dtype), []).append(i)
        else:
            out[i] = without_partial(v)
    if buckets:
        from torch.distributed.tensor import DTensor, Replicate
    for (_, dims, dtype), indices in buckets.items():
        mesh = out[indices[0]].device_mesh
        with torch.no_grad():
            locals_ = [out[i].to_local() for i in indices]
            packed = torch.cat([t.reshape(-1) for t in locals_]).to(dtype)
            for d, op in dims:
                dist.all_reduce(packed, group=mesh.get_group(d))
                if op == "avg":
                    packed.div_(mesh.size(d))
        offset = 0
        for i, local in zip(indices, locals_):
            t = out[i]
            reduced = packed[offset : offset + local.numel()].view(local.shape)
            offset += local.numel()
            placements = [Replicate() if p.is_partial() else p for p in t.placements]
            out[i] = DTensor.from_local(
                reduced, mesh, placements, run_check=False, shape=t.shape, stride=t.stride()
            )
    return out


def splits_over_ranks(params: list[Any]) -> bool:
    """Some DTensor parameter is sharded: no single rank writes every row of the model."""
    return any(is_dtensor(p) and isinstance(placement_of(p), Sharded) for p in params)
