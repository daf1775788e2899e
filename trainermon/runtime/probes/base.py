"""The probe interface (see the package docstring)."""

from __future__ import annotations

from typing import Any

from trainermon.config import MonitorConfig

from ..plan import StepPlan


class Probe:
    def __init__(self, loop: Any) -> None:
        self.loop = loop  # the StepLoop: rows go to loop.record / loop.record_local

    def attach(self) -> list[Any]:
        return []

    def configure(self, config: MonitorConfig) -> None:
        pass

    def begin(self, plan: StepPlan) -> None:
        pass

    def grads_final(self, plan: StepPlan) -> None:
        pass

    def pre_optim(self, plan: StepPlan) -> None:
        pass

    def post_optim(self, plan: StepPlan) -> None:
        pass

    def end(self, plan: StepPlan) -> None:
        pass

    def close(self) -> None:
        pass
