"""An arm of the overhead benchmark: one model, optimizer and batch, with no monitor, trainermon or msprobe.

`build_arm` attaches the tool under one of `CONFIGS`, `run_step` times one training step (and trainermon's
own time inside it), `close_arm` detaches. Used by `benchmarks/overhead.py` and the scripts built on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from benchmarks.workloads import Workload

# msprobe prints INFO lines per step to stdout; errors only (read when msprobe is imported)
os.environ.setdefault("MSPROBE_LOG_LEVEL", "3")
OPS = ["norm", "min", "max", "mean"]
CONFIGS: dict[str, dict[str, Any]] = {
    # idle carries the widest config: what is attached is everything, what runs is nothing
    "idle": {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "mv_distribution": True,
             "param_distribution": True},
    "wg": {"wg_distribution": True},
    "wg+mv+param": {"wg_distribution": True, "mv_distribution": True, "param_distribution": True},
    "all": {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "mv_distribution": True,
            "param_distribution": True},
}  # fmt: skip


def msprobe_available() -> tuple[bool, str]:
    try:
        from msprobe.pytorch import TrainerMon  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
        return False, f"msprobe not importable ({type(exc).__name__}: {exc}); pip install mindstudio-probe"
    from importlib.metadata import version

    try:
        return True, f"mindstudio-probe {version('mindstudio-probe')}"
    except Exception:  # noqa: BLE001
        return True, "mindstudio-probe (version unknown)"


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def write_config(directory: str, tool: str, config: str) -> str:
    body: dict[str, Any] = {"targets": {}, "ops": OPS, "format": "csv", **CONFIGS[config]}
    if config == "idle":
        body.update(dynamic_on=False, collect_times=100_000_000)
    # msprobe refuses paths with characters such as '+'
    path = os.path.join(directory, f"{tool}-{config.replace('+', '_')}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(body, fh)
    return path


class OwnTimer:
    """trainermon's own time on the training thread: the step loop sums it at its entry points (the step
    events, the step boundary, every batch of rows added from a gradient tap, and every activation
    hook's whole body; outermost call only)."""

    def __init__(self, monitor: Any) -> None:
        self.loop = monitor.loop
        self._start = self.loop.clock.total_s

    @property
    def total(self) -> float:
        return self.loop.clock.total_s - self._start

    @total.setter
    def total(self, value: float) -> None:
        self._start = self.loop.clock.total_s - value


@dataclass
class Arm:
    tool: str  # none | trainermon | msprobe
    config: str  # "-" for none
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    monitor: Any = None
    timer: OwnTimer | None = None
    times: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "none" if self.tool == "none" else f"{self.tool}[{self.config}]"


_backward_hook_patch: tuple[Any, Any] | None = None


def build_arm(work: Workload, tool: str, config: str, out_dir: str) -> Arm:
    torch.manual_seed(0)
    model = work.build()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    arm = Arm(tool, config, model, optimizer, work.batch(), work.loss)
    if tool == "none":
        return arm
    dynamic = "true" if config == "idle" else None
    path = write_config(out_dir, tool, config)
    with (
        _env("DYNAMIC_MONITOR", dynamic),
        _env("MONITOR_OUTPUT_DIR", os.path.join(out_dir, tool, config.replace("+", "_"))),
    ):
        if tool == "trainermon":
            from trainermon import TrainerMon

            arm.monitor = TrainerMon(path)
            arm.monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
            arm.timer = OwnTimer(arm.monitor)
        else:
            arm.monitor = _attach_msprobe(path, model, optimizer)
    return arm


def _attach_msprobe(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    global _backward_hook_patch
    from msprobe.pytorch import TrainerMon as MsprobeMon
    from torch.utils.hooks import BackwardHook

    monitor = MsprobeMon(path, params_have_main_grad=False)
    monitor.set_monitor(model, optimizer, grad_acc_steps=1)
    # msprobe wraps torch's BackwardHook.setup_*_hook process-wide each time it registers hooks; with
    # several msprobe instances in one process the wrappers would nest (one extra clone per instance).
    # Keep exactly one level, as in a real job with one monitor.
    current = (BackwardHook.setup_input_hook, BackwardHook.setup_output_hook)
    if _backward_hook_patch is None:
        if current[0].__name__ == "wrapped_setup":
            _backward_hook_patch = current
    else:
        BackwardHook.setup_input_hook, BackwardHook.setup_output_hook = _backward_hook_patch
    return monitor


def run_step(arm: Arm) -> None:
    if arm.timer is not None:
        arm.timer.total = 0.0
    x, y = arm.batch
    t0 = time.perf_counter()
    arm.optimizer.zero_grad(set_to_none=True)
    arm.loss(arm.model(x), y).backward()
    arm.optimizer.step()
    arm.times.append(time.perf_counter() - t0)
    if arm.timer is not None:
        arm.own.append(arm.timer.total)


def close_arm(arm: Arm) -> None:
    if arm.tool == "trainermon" and arm.monitor is not None:
        arm.monitor.close()
    elif arm.tool == "msprobe" and arm.monitor is not None:
        writer = getattr(arm.monitor, "summary_writer", None)
        if writer is not None and hasattr(writer, "close"):
            with contextlib.suppress(Exception):
                writer.close()
