"""Lightning integration (checked with lightning 2.6, automatic and manual optimization).

    from trainermon.integrations.lightning import TrainerMonCallback
    trainer = lightning.Trainer(callbacks=[TrainerMonCallback("monitor_config.json")])
    trainer.fit(module, datamodule)

The monitor attaches in `on_train_start` (after the strategy wrapped the model and set the optimizers
up), to `trainer.strategy.model` (the DDP wrapper under the DDP strategy) and the torch optimizer, with
`grad_acc_steps = trainer.accumulate_grad_batches` and the step counter starting at
`trainer.global_step` (optimizer steps). Lightning's automatic optimization runs forward and backward
inside `optimizer.step(closure)`: the monitor reads the step's gradients when the closure returns. It
closes in `on_train_end` (and on an exception). With several optimizers (manual optimization) the first
is monitored (one warning), and since `trainer.global_step` then counts every optimizer's steps, the step
counter starts at the first one's own count: the largest `step` in its restored state (Adam, AdamW, ...),
else `trainer.global_step // len(optimizers)` (the warning says which).

`on_before_optimizer_step` tells the skip probe that a step call came (runtime/skips.py): a GradScaler
skip is closed as its own step only after one, so the `zero_grad()` that Lightning runs before validation
in the middle of a manual accumulation does not close a step; `opt.zero_grad()` on the LightningOptimizer
is watched like the optimizer's own. Works with the `lightning` package, or
`pytorch_lightning` where only that is installed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ._attach import check_config, start_monitor

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

logger = logging.getLogger("trainermon")


class TrainerMonCallback(Callback):
    def __init__(self, config_file_path: str | os.PathLike) -> None:
        self.config_file_path = check_config(config_file_path)
        self.monitor: Any = None
        self._skips: Any = None  # the monitor's skip probe, told of each step call
        self._patches: list = []
        self._restored: dict | None = None  # the monitor's state from a checkpoint, until it attaches

    def state_dict(self) -> dict:
        """Saved by Lightning in its checkpoints: the monitor's position (`TrainerMon.state_dict`: the count
        toward collect_times, the anomaly history), so that `fit(ckpt_path=...)` goes on from there."""
        if self.monitor is None:
            return {}
        try:
            return {"monitor": self.monitor.state_dict()}
        except Exception:  # noqa: BLE001 - the checkpoint is saved without it
            logger.exception("trainermon: the monitor's state is left out of this checkpoint")
            return {}

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._restored = None  # before Lightning restores this run's checkpoint (validate/test runs too)

    def load_state_dict(self, state_dict: dict) -> None:
        """Lightning restores callbacks before `on_train_start` attaches the monitor: applied there."""
        self._restored = state_dict.get("monitor")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        optimizers = list(trainer.optimizers)
        step = int(trainer.global_step)
        if len(optimizers) > 1:
            step, source = _first_optimizer_steps(optimizers, step)
            logger.warning(
                "trainermon: %d optimizers; only the first (%s) is monitored, from step %d (%s)",
                len(optimizers),
                type(optimizers[0]).__name__,
                step,
                source,
            )
        self.monitor = start_monitor(
            self.config_file_path,
            trainer.strategy.model or pl_module,
            optimizers[0] if optimizers else None,
            int(trainer.accumulate_grad_batches),
            step,
        )
        restored, self._restored = self._restored, None
        if self.monitor is not None and restored is not None:
            try:
                self.monitor.load_state_dict(restored)
            except Exception as exc:  # noqa: BLE001 - training goes on, monitored from a fresh position
                self.monitor.faults.record(
                    "restoring the monitor's state", exc, "the checkpoint's is not applied"
                )
        if self.monitor is not None:
            from trainermon.runtime.skips import report_step_calls

            self._skips = report_step_calls(self.monitor.loop)
        if self._skips is not None:
            # What `self.optimizers()` returns under manual optimization: its zero_grad() is
            # Optimizer.zero_grad run on the wrapper, which never reaches the optimizer's patched one.
            try:
                wrappers = pl_module.optimizers()
                for wrapper in wrappers if isinstance(wrappers, list) else [wrappers]:
                    if getattr(wrapper, "optimizer", None) is optimizers[0]:
                        self._patches.append(self._skips.watch_zero_grad(wrapper))
            except Exception:  # noqa: BLE001 - training goes on; skips are then closed at other zero_grads
                logger.exception("trainermon: LightningOptimizer.zero_grad not watched")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._skips is not None:
            self._skips.step_called(optimizer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        self._skips = None
        while self._patches:
            self._patches.pop().remove()
        if self.monitor is not None:
            self.monitor.close()  # idempotent; kept for its run_dir and faults


def _first_optimizer_steps(optimizers: list, global_step: int) -> tuple[int, str]:
    """The first optimizer's own step count, and where it came from: `trainer.global_step` sums the steps
    of every optimizer under manual optimization (the only one that takes several)."""
    counts = [s["step"] for s in optimizers[0].state.values() if isinstance(s, dict) and "step" in s]
    if counts:
        return int(max(float(c) for c in counts)), "its restored state's largest `step`"
    if global_step == 0:
        return 0, "trainer.global_step"
    n = len(optimizers)
    return global_step // n, f"its state keeps no step count: trainer.global_step // {n}"
