"""Where a monitored tensor's values live across ranks. Adapters describe tensors with these; the
collector merges and picks the one writer. The model is N-D: a tensor may be split over several process
groups at once (tensor parallel x data parallel under a distributed optimizer) and copied over others.

- `Local`: this rank's own values (activations, pre-reduce gradients). Every rank writes its rows.
- `Replicated(*groups)`: the whole tensor, identical on every rank of each group (DDP's reduced
  gradients; a layernorm duplicated over tensor-parallel ranks and data-parallel replicas). Computed
  and written only by the rank whose coordinate is 0 in every group.
- `Sharded(*over, replicated=())`: this rank holds a disjoint piece of the tensor, and the pieces of all
  ranks of the product of the `over` groups make the whole tensor (ZeRO, FSDP, Megatron's distributed
  optimizer, tensor-parallel weights split along `partition_dim`, DTensor `Shard` mesh dims). The whole
  sharded arrangement may itself be copied over the `replicated` groups (data-parallel replicas of a
  tensor-parallel weight). Partials are merged over each `over` group in turn; only ranks at
  coordinate 0 of every `replicated` group take part, and the rank at coordinate 0 of every group writes.

Groups are torch.distributed process groups; `None` is the default (world) group. The groups of one
placement must be orthogonal (as the dimensions of a device mesh are): the members of an `over` group
share their coordinate in every other group of the placement. Adapters list `over` groups in mesh
dimension order, the same on every rank (the collector merges one dimension at a time, in the order the
groups first appear: ranks that meet in a group must have merged the same dimensions before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class Local:
    pass


@dataclass(frozen=True, init=False)
class Replicated:
    groups: tuple[Any, ...]

    def __init__(self, *groups: Any) -> None:
        object.__setattr__(self, "groups", groups or (None,))

    @property
    def over(self) -> tuple[Any, ...]:  # nothing to merge
        return ()

    @property
    def replicated(self) -> tuple[Any, ...]:
        return self.groups


@dataclass(frozen=True, init=False)
class Sharded:
    over: tuple[Any, ...]
    replicated: tuple[Any, ...]

    def __init__(self, *over: Any, replicated: tuple[Any, ...] = ()) -> None:
        object.__setattr__(self, "over", over or (None,))
        object.__setattr__(self, "replicated", tuple(replicated))


Placement = Local | Replicated | Sharded
LOCAL = Local()


class TensorPiece(NamedTuple):
    """One rank's view of a monitored tensor: its local values (None if it holds no elements) plus the
    full tensor's shape and dtype, which are what the output reports. `shard` labels a `Local` piece that
    is part of a larger tensor (a tensor-parallel rank's pre-reduce gradient), e.g. `Shard(0)[tp=1/2]`.
    A named tuple, because adapters build one per parameter per collected step."""

    tensor: torch.Tensor | None
    placement: Placement
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    shard: str = ""

    @staticmethod
    def whole(tensor: torch.Tensor, placement: Placement = LOCAL) -> TensorPiece:
        return TensorPiece(tensor, placement, tuple(tensor.shape), tensor.dtype)

    @property
    def local_numel(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def group_rank(group: Any) -> int:
    """This rank's index within `group` (0 when not distributed)."""
    import torch.distributed as dist

    if not _distributed():
        return 0
    return dist.get_rank(group=group)


#: ids of the groups (`None`: the default group) in which this rank is the only one still stepping (a Join
#: context whose other ranks ran out of inputs): it computes and writes their `Replicated` rows itself
_SOLE: set[int] = set()


def stepping_alone(*groups: Any) -> None:
    """This rank alone still steps in each of `groups` (`None` for the default group): it writes their
    `Replicated` rows from now on. The collector caches roles per placement: clear that cache after."""
    _SOLE.update(id(g) for g in groups)


def stepping_with_others() -> None:
    """Forget `stepping_alone`: more than one rank steps again (the Join context ended); a monitor's close."""
    _SOLE.clear()


def takes_part(placement: Placement) -> bool:
    """This rank computes the placement's rows: every rank for `Local`; for the others, the ranks at
    coordinate 0 of every replicated group (each replica would merge and write the same values), or, for
    `Replicated`, the rank alone still stepping in each of its groups (`stepping_alone`)."""
    if isinstance(placement, Local):
        return True
    if _SOLE and isinstance(placement, Replicated) and all(id(g) in _SOLE for g in placement.groups):
        return True
    return all(group_rank(g) == 0 for g in placement.replicated)


def writes_rows(placement: Placement) -> bool:
    """The one rank that writes the placement's rows: coordinate 0 in every group it names."""
    if isinstance(placement, Local):
        return True
    return takes_part(placement) and all(group_rank(g) == 0 for g in placement.over)
