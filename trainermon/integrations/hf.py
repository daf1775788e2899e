"""Hugging Face `Trainer` integration (checked with transformers 5 and accelerate 1).

    from trainermon.integrations.hf import TrainerMonCallback
    callback = TrainerMonCallback("monitor_config.json")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train()

The monitor attaches in `on_train_begin`, to the model and optimizer the Trainer prepared (accelerate's
`AcceleratedOptimizer` is unwrapped; under DDP the Trainer's DDP wrapper is found and used, so
`grad_unreduced` is each rank's own gradient), with `grad_acc_steps = args.gradient_accumulation_steps`
and the step counter starting at `state.global_step` (a resumed run continues its numbering; steps are
optimizer steps numbered from 0: the monitor's step s is the update the Trainer logs as global step
s + 1, and `checkpoint-N` holds steps 0 to N - 1). Each checkpoint the Trainer saves gets the monitor's
`state_dict()` (`checkpoint-N/trainermon_state_rank{R}.pt`, every rank its own), and a run resumed from a
checkpoint (`resume_from_checkpoint=True`, or its folder wherever it was moved) loads the one in the folder
the Trainer resumed from: the count toward `collect_times` and the anomaly rules' history go on (a
checkpoint without it is said once; a rank the saving job did not have loads rank 0's, so that every
rank collects the same steps). It closes (flushes every collected step) in
`on_train_end`. `monitor` is the `TrainerMon` of the latest `train()` call.
"""

from __future__ import annotations

import logging
import os
import sys
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
        folder = resumed_from(args, state)
        path = os.path.join(folder, self._state_name())
        if not os.path.exists(path):  # a rank the saving job did not have (restarted on more ranks)
            path = os.path.join(folder, self._state_name(rank=0))  # every rank must collect alike
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

    def _state_name(self, rank: int | None = None) -> str:
        return f"trainermon_state_rank{self.monitor.loop.rank if rank is None else rank}.pt"

    def _state_path(self, args: Any, state: Any) -> str:
        """Where the Trainer saves `checkpoint-N` (`args.output_dir`)."""
        return os.path.join(args.output_dir, f"checkpoint-{state.global_step}", self._state_name())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()  # idempotent; kept for its run_dir and faults


#: Trainer methods that hold the checkpoint folder being resumed from in a local of this name.
_RESUMING_FRAMES = ("_inner_training_loop", "train")


def resumed_from(args: Any, state: Any) -> str:
    """The checkpoint folder the Trainer resumed from. It hands the path to no callback (`train`'s
    `resume_from_checkpoint`, True resolved to the last checkpoint, reaches `_inner_training_loop`, which
    calls `on_train_begin`), so it is read from those frames' locals, once per `train()`. Else
    `args.resume_from_checkpoint` (a path; the example scripts pass it on), else `checkpoint-N` in
    `args.output_dir`, where `resume_from_checkpoint=True` looks."""
    frame = sys._getframe(1)
    while frame is not None:
        value = (
            frame.f_locals.get("resume_from_checkpoint") if frame.f_code.co_name in _RESUMING_FRAMES else None
        )
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
        frame = frame.f_back
    given = getattr(args, "resume_from_checkpoint", None)
    if isinstance(given, (str, os.PathLike)) and os.path.isdir(given):
        return os.fspath(given)
    return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
