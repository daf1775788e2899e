"""Optimizer-side families: param_origin before the update; the optimizer's state (mv_distribution:
exp_avg and exp_avg_sq for Adam, each optimizer's own keys otherwise, see `runtime.moments`) and
param_updated after it (so step 0 has the state; msprobe reads it before the update and lags one step)."""

from __future__ import annotations

from typing import Any

from trainermon.adapters.base import PARAM
from trainermon.config import MonitorConfig

from ..moments import MomentKeys
from ..plan import StepPlan
from .base import Probe


class OptimizerProbe(Probe):
    def __init__(self, loop: Any) -> None:
        super().__init__(loop)
        self.moments: MomentKeys | None = None

    def configure(self, config: MonitorConfig) -> None:
        """At set_monitor and at each reload: which state keys exist, with one warning when none does."""
        if config.mv_distribution:
            if self.moments is None:
                self.moments = MomentKeys(self.loop.adapter.optimizer)
            self.moments.warn_if_none()

    def pre_optim(self, plan: StepPlan) -> None:
        if plan.params:
            self.loop.record_params("param_origin", PARAM)

    def post_optim(self, plan: StepPlan) -> None:
        loop = self.loop
        if plan.moments and self.moments is not None:
            for key in self.moments.for_step():
                loop.record_params(key, key)
        if plan.params:
            loop.record_params("param_updated", PARAM)
