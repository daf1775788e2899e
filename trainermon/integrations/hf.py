"""Hugging Face `Trainer` integration (checked with transformers 5 and accelerate 1).

    from trainermon.integrations.hf import TrainerMonCallback
    callback = TrainerMonCallback("monitor_config.json")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train()

The monitor attaches in `on_train_begin`, to the model and optimizer the Trainer prepared (accelerate's
`AcceleratedOptimizer` is unwrapped; under DDP the Trainer's DDP wrapper is found and used, so
`grad_unreduced` is each rank's own gradient), with `grad_acc_steps = args.gradient_accumulation_steps`
and the step counter starting at `state.global_step` (a resumed run continues its numbering; steps are
optimizer steps, i.e. the Trainer's global steps). It closes (flushes every collected step) in
`on_train_end`. `monitor` is the `TrainerMon` of the latest `train()` call.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from ._attach import check_config, ddp_wrapper_of, start_monitor


class TrainerMonCallback(TrainerCallback):
    def __init__(self, config_file_path: str | os.PathLike) -> None:
        self.config_file_path = check_config(config_file_path)
        self.monitor: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()  # a second train() call gets a fresh monitor
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None:
            return
        self.monitor = start_monitor(
            self.config_file_path,
            ddp_wrapper_of(model),
            optimizer,
            int(args.gradient_accumulation_steps),
            int(state.global_step),
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()  # idempotent; kept for its run_dir and faults
