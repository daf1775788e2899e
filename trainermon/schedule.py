"""Which steps are collected: start_step, step_interval and collect_times, as msprobe defines them."""

from __future__ import annotations

from .config import MonitorConfig


class Schedule:
    """Collected steps are start_step, start_step + step_interval, ... until collect_times steps have been
    collected. Steps are optimizer steps, counted from `start_iteration`."""

    def __init__(self, config: MonitorConfig) -> None:
        self.start_step = config.start_step
        self.step_interval = config.step_interval
        self.collect_times = config.collect_times
        self.collected = 0

    def wants(self, step: int) -> bool:
        if self.collected >= self.collect_times or step < self.start_step:
            return False
        return (step - self.start_step) % self.step_interval == 0

    def mark_collected(self) -> None:
        self.collected += 1

    @property
    def exhausted(self) -> bool:
        return self.collected >= self.collect_times
