"""torch's `ZeroRedundancyOptimizer` (checked on torch 2.13): where each parameter's optimizer state lives.

ZeroRedundancyOptimizer partitions whole parameters over the ranks of its process group
(`_param_to_rank`, a greedy split by size, the same on every rank). Each rank's local optimizer
(`.optim`, built from `optimizer_class`) holds the state of the parameters it owns, whole; the
ZeroRedundancyOptimizer's own `.state` stays empty. After the local update it broadcasts each owner's
updated parameters, so parameters and DDP's reduced gradients stay replicated as under plain DDP: only
the optimizer state needs this module.

A state tensor is described as `Sharded(group)`: the owner's piece is the whole tensor, every other
rank's piece is empty, so the collector's merge over the group gives exactly the owner's statistics and
the group's rank 0 writes them (one row per parameter and key, whoever owns it). Which rows exist must be
the same on every rank (they enter one packed reduction), but only the owner knows whether a parameter
has state yet (Adam makes it at the parameter's first update with a gradient): that is agreed over the
group by `AgreedRows`, on its back-off schedule.

A ZeroRedundancyOptimizer over a subgroup (several of them, each over its own ranks) is said once: each
group's rank 0 writes its rows (the copies over the other groups are not known here).

Not read: `overlap_with_ddp=True` (the local optimizer is a functional one, built lazily and stepped from
DDP's communication hook; `ZeroRedundancyOptimizer.step()` is not called, so no step hook runs), and a
local optimizer class whose state keys are not documented in `runtime.moments` (finding its keys from the
state would be a rank-local decision: only owners hold state). `runtime.moments` says both once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from trainermon.collect.placement import Sharded, TensorPiece
from trainermon.runtime.moments import is_zero_redundancy, overlapped

from .common import AgreedRows

logger = logging.getLogger("trainermon")


class ZeroRedundancyState:
    """Reads one ZeroRedundancyOptimizer's state as pieces of `Sharded(its group)`. Build it with
    `zero_state` (None for any other optimizer)."""

    def __init__(self, optimizer: Any) -> None:
        import torch.distributed as dist

        self.optimizer = optimizer
        group = optimizer.process_group
        # the default group as None, as adapters name it: one packed reduction with their rows
        self.group = None if group is dist.group.WORLD else group
        self.placement = Sharded(self.group)
        self.rank = int(optimizer.rank)
        self._agreed = AgreedRows()
        self._groups = len(optimizer.param_groups)
        self._said = False
        if self.group is not None and dist.get_world_size(self.group) < dist.get_world_size():
            # Its copies over the other ranks are not known here: each group's rank 0 writes its rows.
            logger.warning(
                "trainermon: mv_distribution: the ZeroRedundancyOptimizer's process group is a subgroup "
                "(%d of %d ranks): its state rows are written by rank 0 of each such group",
                dist.get_world_size(self.group),
                dist.get_world_size(),
            )

    def read(self, params: Sequence[Any], key: str) -> list[TensorPiece | None]:
        """One piece per monitored parameter (`MonitoredParam`s, the same on every rank) of state `key`:
        the whole state tensor on its owner, an empty piece elsewhere, None where no rank holds it.
        Costs, per collected step and key: a len() of the param groups, two dict lookups per parameter,
        and `AgreedRows`' all-reduce of one int32 per parameter on the reads its schedule picks while some
        parameter has no state on any rank (the first read of each key, then 1, 2, 4, ... up to every 64th,
        and the first read after an add_param_group)."""
        zro = self.optimizer
        if len(zro.param_groups) != self._groups:
            # add_param_group (the same on every rank): ask about every parameter without state afresh,
            # so the added ones have rows from their first state on, not after the back-off's gap
            self._groups = len(zro.param_groups)
            self._agreed = AgreedRows()
        owners = zro._param_to_rank  # private: {param: rank in the group}, cached by ZeRO
        state = zro.optim.state
        values: list[torch.Tensor | None] = []
        for mp in params:
            value = None
            if owners.get(mp.param) == self.rank:
                entry = state.get(mp.param)
                value = None if entry is None else entry.get(key)
            values.append(value if isinstance(value, torch.Tensor) else None)
        if not self._said and any(mp.param not in owners for mp in params):
            self._said = True
            logger.warning(
                "trainermon: mv_distribution: some monitored parameters are not in the "
                "ZeroRedundancyOptimizer; they have no optimizer-state rows while they are not in it "
                "(parameters added later with add_param_group have rows from their first state on)"
            )
        device = zro._default_device
        held = self._agreed.state(
            key, [mp.index for mp in params], [v is not None for v in values], [self.group], device
        )
        out: list[TensorPiece | None] = []
        for mp, value, on in zip(params, values, held):
            if not on:
                out.append(None)
            elif value is not None:
                out.append(TensorPiece(value, self.placement, tuple(value.shape), value.dtype))
            else:  # not the owner (or state gained since the last agreement): an empty piece
                p = mp.param
                out.append(TensorPiece(p.detach().new_empty(0), self.placement, tuple(p.shape), p.dtype))
        return out


def zero_state(optimizer: Any) -> ZeroRedundancyState | None:
    """The state reader for a ZeroRedundancyOptimizer whose state trainermon reads (not one with
    `overlap_with_ddp=True`), else None."""
    if optimizer is None or not is_zero_redundancy(optimizer) or overlapped(optimizer):
        return None
    return ZeroRedundancyState(optimizer)
