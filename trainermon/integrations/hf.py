"""Hugging Face `Trainer` integration (checked with transformers 5 and accelerate 1).

    from trainermon.integrations.hf import TrainerMonCallback
    callback = TrainerMonCallback("monitor_config.json")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train()

The monitor attaches in `on_train_begin`, to the model and optimizer the Trainer prepared (accelerate's
`AcceleratedOptimizer` is unwrapped; under DDP the Trainer's DDP wrapper is found and used, so
`grad_unreduced` is each rank's own gradient), with `grad_acc_steps = args.gradient_accumulation_steps`
and the step counter starting at `state.global_step` (a resumed run continues its numbering; steps are
optimizer steps, i.e. the Trainer's global steps). Each checkpoint the Trainer saves gets the monitor's
`state_dict()` (`checkpoint-N/trainermon_state_rank{R}.pt`, every rank its own), and a run resumed from
`checkpoint-N` in `args.output_dir` loads it: the count toward `collect_times` and the anomaly rules'
history go on (a checkpoint without it is said once; a rank the saving job did not have loads rank 0's,
so that every rank collects the same steps). It closes (flushes every collected step) in
`on_train_end`. `monitor` is the `TrainerMon` of the latest `train()` call.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import TrainerCallback

from ._attach import check_config, ddp_wrapper_of, start_monitor

logger = logging.getLogger("trainermon")


class TrainerMonCallback(TrainerCallback):
    def __init__(self, config_file_path: str | os.PathLike) -> None:
        self.config_file_path = check_config(config_file_path)
        self.monitor: Any = None
        self._said_no_folder = False

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
        if self.monitor is not None and state.global_step > 0:
            self._restore(args, state)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After the Trainer saved `checkpoint-N`: the monitor's position beside it (waits for the
        background worker, as `state_dict` does)."""
        if self.monitor is None:
            return
        path = self._state_path(args, state)
        if getattr(state, "trial_params", None) is not None or not os.path.isdir(os.path.dirname(path)):
            # a hyperparameter-search trial saves under its own run-<id>/ folder; a node without the folder
            if not self._said_no_folder:
                self._said_no_folder = True
                logger.warning(
                    "trainermon: %s is not this run's checkpoint folder here: the monitor's "
                    "state is not saved with its checkpoints",
                    os.path.dirname(path),
                )
            return
        try:
            torch.save(self.monitor.state_dict(), path)
        except Exception as exc:  # noqa: BLE001 - a checkpoint the monitor cannot add to still stands
            self.monitor.faults.record("saving the monitor's state", exc, f"{path} not written")

    def _restore(self, args: Any, state: Any) -> None:
        path = self._state_path(args, state)
        if not os.path.exists(path):  # a rank the saving job did not have (restarted on more ranks)
            path = self._state_path(args, state, rank=0)  # its schedule: every rank must collect alike
        if not os.path.exists(path):
            logger.warning(
                "trainermon: resumed at step %d without %s: the monitor's count toward collect_times and "
                "its anomaly history start afresh",
                state.global_step,
                path,
            )
            return
        try:
            self.monitor.load_state_dict(torch.load(path, weights_only=True))
        except Exception as exc:  # noqa: BLE001 - training goes on, monitored from a fresh position
            self.monitor.faults.record("restoring the monitor's state", exc, f"{path} not applied")

    def _state_path(self, args: Any, state: Any, rank: int | None = None) -> str:
        name = f"trainermon_state_rank{self.monitor.loop.rank if rank is None else rank}.pt"
        return os.path.join(args.output_dir, f"checkpoint-{state.global_step}", name)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()  # idempotent; kept for its run_dir and faults
