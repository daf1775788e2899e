"""Where a monitored tensor's values live across ranks. Adapters describe tensors with these.

- `Local`: this rank's own values (activations, pre-reduce gradients). Every rank writes its rows.
- `Replicated`: the whole tensor, identical on every rank of `group` (DDP's reduced gradients, its
  optimizer state). Statistics are computed locally; only the group's first rank writes them.
- `Sharded`: this rank holds a disjoint piece of the tensor (ZeRO, FSDP, the distributed optimizer).
  Partial statistics are merged across `group` in one packed reduction; only the first rank writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class Local:
    pass


@dataclass(frozen=True)
class Replicated:
    group: Any = None  # a torch.distributed ProcessGroup; None = the default group


@dataclass(frozen=True)
class Sharded:
    group: Any = None


Placement = Local | Replicated | Sharded
LOCAL = Local()


class TensorPiece(NamedTuple):
    """One rank's view of a monitored tensor: its local values (None if it holds no elements) plus the
    full tensor's shape and dtype, which are what the output reports. A named tuple, because adapters
    build one per parameter per collected step."""

    tensor: torch.Tensor | None
    placement: Placement
    full_shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def whole(tensor: torch.Tensor, placement: Placement = LOCAL) -> TensorPiece:
        return TensorPiece(tensor, placement, tuple(tensor.shape), tensor.dtype)

    @property
    def local_numel(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()


def group_rank(group: Any) -> int:
    """This rank's index within `group` (0 when not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group=group)


def writes_rows(placement: Placement) -> bool:
    """Replicated and sharded values are written once per group, by its first rank."""
    if isinstance(placement, Local):
        return True
    return group_rank(placement.group) == 0
