"""The `update` family: statistics of this step's optimizer update dw = w_after - w_before of every
selected parameter, and (derived on the worker, `pipeline/derive.py`) the ratio ||dw|| / ||w_before||.

Exact full-parameter values under every layout, from the same pieces the adapter hands out for
`param_origin` / `param_updated` (a ZeRO / FSDP / distributed-optimizer shard, a tensor-parallel piece, or
the whole tensor): dw of a piece is the piece of dw, so its partials merge across shards like any
other family's (sum of squares, sum, min, max), and ||w_before|| travels beside it as a hidden row of the
same placement (`BASE`), merged the same way and dropped by the worker once the ratio is formed.

Memory: on collected steps only, between the optimizer's pre- and post-step hooks, one copy of this
rank's pieces of the selected parameters (in their own dtype; `targets` narrows it). Under sharded
layouts that is this rank's shard (1/N of the parameters), under plain DDP the full local parameters.
No copy outlives the step; dw is formed in place in the copy (float32 and wider) or, for narrower
dtypes, in one float32 temporary of one parameter at a time. The optimizer updates every parameter in
one call (foreach / fused kernels), so the values before it cannot be taken a parameter at a time.
"""

from __future__ import annotations

import torch

from trainermon.adapters.base import PARAM
from trainermon.collect.placement import LOCAL, Sharded, TensorPiece
from trainermon.pipeline.derive import UPDATE_BASE as BASE
from trainermon.pipeline.derive import UPDATE_FAMILY as FAMILY
from trainermon.stats.kinds import local_view

from ..plan import StepPlan
from .base import Probe

# BASE, a hidden family: ||w_before|| partials of the same pieces; the worker pairs and removes its rows.
_EXACT_INPLACE = (torch.float32, torch.float64)


class UpdateProbe(Probe):
    def __init__(self, loop) -> None:
        super().__init__(loop)
        self._before: list | None = None  # per selected parameter: (piece, copy of its local values)

    def begin(self, plan: StepPlan) -> None:
        self._before = None  # a step whose post hook never ran must not leave its copies behind

    def pre_optim(self, plan: StepPlan) -> None:
        self._before = None
        if not plan.update:
            return
        loop, sel = self.loop, self.loop.selection
        pieces = [_plain(p) for p in loop.adapter.read(PARAM, sel.params)]
        loop.record(BASE, sel.entries(pieces))
        self._before = [
            None if p is None or p.tensor is None else (p, p.tensor.detach().clone()) for p in pieces
        ]

    def post_optim(self, plan: StepPlan) -> None:
        before, self._before = self._before, None
        if not plan.update or before is None:
            return
        loop, sel = self.loop, self.loop.selection
        after = [_plain(p) for p in loop.adapter.read(PARAM, sel.params)]
        deltas: list[TensorPiece | None] = []
        for old, new in zip(before, after):
            if new is None:
                deltas.append(None)
                continue
            if old is None or new.tensor is None:  # no elements on this rank: an empty piece
                deltas.append(new._replace(tensor=None) if isinstance(new.placement, Sharded) else None)
                continue
            piece, copy = old
            value = new.tensor.detach()
            if copy.dtype in _EXACT_INPLACE and value.dtype == copy.dtype:
                delta = copy.sub_(value).neg_()  # w_before - w_after, negated: exactly w_after - w_before
            elif value.is_floating_point() and copy.is_floating_point():
                delta = value.float() - copy.float()  # both exact in float32
            else:  # complex: kept complex, so the engine refuses it as it refuses a complex parameter
                delta = value - copy
            deltas.append(new._replace(tensor=delta))
        loop.record(FAMILY, sel.entries(deltas))


def _plain(piece: TensorPiece | None) -> TensorPiece | None:
    """The piece with a plain local tensor: a DTensor that its placement does not already describe is
    this rank's local piece (as the collector treats it), labelled with its shard."""
    if piece is None or piece.tensor is None:
        return piece
    tensor, shard = local_view(piece.tensor)
    if tensor is piece.tensor:
        return piece
    if shard and not isinstance(piece.placement, Sharded):
        return TensorPiece(tensor, LOCAL, tuple(tensor.shape), piece.dtype, shard)
    return piece._replace(tensor=tensor)
