"""Parameters that become trainable after `set_monitor`: unfrozen (`requires_grad_(True)`) or handed to
the optimizer later with `add_param_group`. At each collected step's boundary the adapter is asked for
them (a count of flags, a rescan only when it changed); new ones join the selection under the config's
targets, with one log line. They are looked for again when the step's gradients are read (`grads_final`),
so a parameter unfrozen during an iteration has its rows from that iteration's step on. Under DDP they
have no pre-reduce tap (DDP itself only reduces the parameters that were trainable when it was built)."""

from __future__ import annotations

import logging

from trainermon.config import MonitorConfig

from .plan import StepPlan
from .probes.base import Probe
from .selection import select_params
from .targets import TargetCheck

logger = logging.getLogger("trainermon")


class NewParamsProbe(Probe):
    """First among the probes: the others read `loop.selection` in their own `begin`. It also says when
    the configured targets select nothing (`targets.TargetCheck`), at attach and at each reload."""

    def __init__(self, loop) -> None:
        super().__init__(loop)
        self.targets = TargetCheck()

    def configure(self, config: MonitorConfig) -> None:
        try:
            self.targets.check(self.loop.adapter, config)
            self.targets.check_switches(config, self.loop.world_size, self.loop.env.dynamic)
        except Exception as exc:  # noqa: BLE001 - a diagnostic never stops set_monitor or a reload
            self.loop.faults.record("target check", exc)

    def begin(self, plan: StepPlan) -> None:
        self._refresh(plan)

    def grads_final(self, plan: StepPlan) -> None:
        self._refresh(plan)

    def _refresh(self, plan: StepPlan) -> None:
        loop = self.loop
        if not plan.scheduled or loop.adapter is None:
            return
        new = loop.adapter.new_parameters()
        if new:
            loop.selection = select_params(loop.adapter, loop.config)
            chosen = {id(mp) for mp in loop.selection.params}
            names = [mp.name for mp in new if id(mp) in chosen]
            logger.info(
                "trainermon: step %d: %d parameter(s) became trainable, %d monitored: %s",
                plan.step,
                len(new),
                len(names),
                ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""),
            )
