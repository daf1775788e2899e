"""ZeRO-0 with a torch optimizer: parameters unfrozen after `set_monitor`.

There DeepSpeed keeps the user's torch optimizer as it is: a parameter it holds that was frozen at setup
and is unfrozen later (`requires_grad_(True)`) gets a gradient, is all-reduced with the others and is
stepped. DeepSpeed's own optimizers (ZeRO 1-3, BF16_Optimizer, FP16_UnfusedOptimizer) keep only the
parameters trainable at setup, so they never grow. `trainermon.runtime.growth.NewParamsProbe` asks at each
collected step (`DeepSpeedAdapter.new_parameters`); a new parameter is appended to the adapter's list in
place (so the PipelineEngine's `ReduceGrads` tap, which holds that list, reads it too) and gets its
grad_unreduced tap, from the next backward on.
"""

from __future__ import annotations

from typing import Any

import torch

from trainermon.names import clean_name

from ..base import GradTaps, MonitoredParam
from . import layout


class Growth:
    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.taps: GradTaps | None = None  # set where the adapter's taps are per-parameter hooks
        self.handles: list[Any] = []
        self._every: list[torch.nn.Parameter] = []
        self._mark: tuple[int, int] = (0, 0)

    def mark_known(self) -> None:
        """Once `parameters()` is built: the flags to watch."""
        self._every = list(self.adapter.engine.module.parameters())
        self._mark = self._count()

    def _count(self) -> tuple[int, int]:
        # trainable flags and the optimizer's parameter count (`add_param_group`): one pass over flags
        opt = self.adapter.optimizer
        return (
            sum(p.requires_grad for p in self._every),
            sum(len(g["params"]) for g in getattr(opt, "param_groups", ())),
        )

    def new_parameters(self) -> list[MonitoredParam]:
        """Parameters trainable now and not yet monitored. Costs, on collected steps only: a count of the
        model's trainable flags (~10 us for 200 parameters); a walk of its parameters when it changed."""
        known = self.adapter.parameters()
        mark = self._count()
        if mark == self._mark:
            return []
        self._every = list(self.adapter.engine.module.parameters())
        self._mark = self._count()
        ids = {id(mp.param) for mp in known}
        renames = self.adapter._renames
        new: list[MonitoredParam] = []
        for name, p in self.adapter.engine.module.named_parameters():
            if p.requires_grad and id(p) not in ids:
                ids.add(id(p))
                new.append(
                    MonitoredParam(len(known) + len(new), 0, layout.rename(clean_name(name), renames), p)
                )
        known.extend(new)  # in place: holders of the list see them
        if new and self.taps is not None:
            self.handles += self.adapter._tap_params(new, self.taps)
        return new

    def remove_taps(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
