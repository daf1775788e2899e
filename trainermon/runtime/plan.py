"""What a step collects: a pure function of the config, the step and the schedule's position.

Steps are optimizer steps, counted from `start_iteration`. Collected steps are start_step, start_step +
step_interval, ... until collect_times steps have been collected (msprobe's definition); in dynamic mode
only while `dynamic_on` is true, and from the step a config applies at (`Schedule(anchored=True)`):
msprobe's rule, the file's start_step is not used there. After an anomaly, escalation adds every module's
activations."""

from __future__ import annotations

from dataclasses import dataclass

from trainermon.config import MonitorConfig


class Schedule:
    """Which steps the configured families are collected at; it counts the collections made."""

    def __init__(self, config: MonitorConfig, collected: int = 0, anchored: bool = False) -> None:
        self.start_step = config.start_step
        self.step_interval = config.step_interval
        self.collect_times = config.collect_times
        self.collected = collected
        # Dynamic mode (`anchored`): collect from the step this config applies at (the next step asked
        # about), every step_interval steps from there; the file's start_step is not used. msprobe anchors
        # start_step at the step a dynamic_on config is read for: a start_step left in the file (0, or a
        # large one from a static run) neither shifts the first collection nor delays it indefinitely.
        self._anchor = anchored

    def wants(self, step: int) -> bool:
        if self._anchor:
            self.start_step, self._anchor = step, False
        if self.collected >= self.collect_times or step < self.start_step:
            return False
        return (step - self.start_step) % self.step_interval == 0

    @property
    def start(self) -> int | None:
        """The first collected step; None while a dynamic schedule waits for the step it anchors at."""
        return None if self._anchor else self.start_step

    def resume(self, start: int) -> None:
        """A restored dynamic run: its grid goes on from the saved run's anchor, not the resumed step."""
        self.start_step, self._anchor = start, False

    def mark_collected(self) -> None:
        self.collected += 1

    @property
    def exhausted(self) -> bool:
        return self.collected >= self.collect_times

    def start_not_reached(self, first: int, end: int) -> str | None:
        """At the end of a run of steps `first` to `end` - 1: why nothing was collected, when the cause is
        a start_step the run never reached (a production config on a short trial run); else None."""
        if self.collected or not self.collect_times or not first < end <= self.start_step:
            return None
        return (
            f"no step was collected: the run ended after {end - first} step(s) (at step {end}), before "
            f"start_step {self.start_step}"
        )


@dataclass(frozen=True)
class StepPlan:
    """The families and hooks of one step. `scheduled`: the configured families; `escalating`: every
    module's activations because of a recent anomaly."""

    step: int
    scheduled: bool = False
    escalating: bool = False
    actv: bool = False
    actv_grad: bool = False
    grads: bool = False  # wg_distribution: grad_unreduced and grad_reduced
    microbatch_grads: bool = False  # monitor_mbs_grad: each micro-batch's own grad_unreduced
    moments: bool = False  # mv_distribution
    params: bool = False  # param_distribution
    update: bool = False  # update_distribution: the optimizer's update of each parameter
    moe: bool = False  # moe_distribution: tokens per expert of every MoE router
    attn: bool = False  # attn_logit_distribution: per-head pre-softmax logit extremes

    @property
    def collecting(self) -> bool:
        """Anything is collected: this step ends with a hand-off to the worker."""
        return self.scheduled or self.escalating


def plan_step(config: MonitorConfig, step: int, scheduled: bool, escalating: bool) -> StepPlan:
    """The plan of `step`, given whether the schedule wants it and whether escalation is on."""
    return StepPlan(
        step=step,
        scheduled=scheduled,
        escalating=escalating,
        actv=(scheduled and config.collects_actv) or escalating,
        actv_grad=(scheduled and config.collects_actv_grad) or escalating,
        grads=scheduled and config.wg_distribution,
        microbatch_grads=scheduled and config.wg_distribution and config.monitor_mbs_grad,
        moments=scheduled and config.mv_distribution,
        params=scheduled and config.param_distribution,
        update=scheduled and config.update_distribution,
        moe=scheduled and config.moe_distribution,
        attn=scheduled and config.attn_logit_distribution.enable,
    )
