"""Lightning integration (checked with lightning 2.6, automatic and manual optimization).

    from trainermon.integrations.lightning import TrainerMonCallback
    trainer = lightning.Trainer(callbacks=[TrainerMonCallback("monitor_config.json")])
    trainer.fit(module, datamodule)

The monitor attaches in `on_train_start` (after the strategy wrapped the model and set the optimizers
up), to `trainer.strategy.model` (the DDP wrapper under the DDP strategy) and the torch optimizer, with
`grad_acc_steps = trainer.accumulate_grad_batches` and the step counter starting at
`trainer.global_step` (optimizer steps). Lightning's automatic optimization runs forward and backward
inside `optimizer.step(closure)`: the monitor reads the step's gradients when the closure returns. It
closes in `on_train_end` (and on an exception). With several optimizers the first is monitored (one
warning). Works with the `lightning` package, or `pytorch_lightning` where only that is installed.
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

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        optimizers = list(trainer.optimizers)
        if len(optimizers) > 1:
            logger.warning(
                "trainermon: %d optimizers; only the first (%s) is monitored",
                len(optimizers),
                type(optimizers[0]).__name__,
            )
        self.monitor = start_monitor(
            self.config_file_path,
            trainer.strategy.model or pl_module,
            optimizers[0] if optimizers else None,
            int(trainer.accumulate_grad_batches),
            int(trainer.global_step),
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()  # idempotent; kept for its run_dir and faults
