"""Optimizer-side families: param_origin before the update; exp_avg, exp_avg_sq and param_updated after
it (so step 0 has the moments; msprobe reads them before the update and lags one step)."""

from __future__ import annotations

from trainermon.adapters.base import PARAM

from ..plan import StepPlan
from .base import Probe

MOMENTS = ("exp_avg", "exp_avg_sq")


class OptimizerProbe(Probe):
    def pre_optim(self, plan: StepPlan) -> None:
        if plan.params:
            sel = self.loop.selection
            self.loop.record("param_origin", sel.entries(self.loop.adapter.read(PARAM, sel.params)))

    def post_optim(self, plan: StepPlan) -> None:
        loop, sel = self.loop, self.loop.selection
        if plan.moments:
            for key in MOMENTS:
                loop.record(key, sel.entries(loop.adapter.read(key, sel.params)))
        if plan.params:
            loop.record("param_updated", sel.entries(loop.adapter.read(PARAM, sel.params)))
