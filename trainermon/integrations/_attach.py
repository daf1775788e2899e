"""What the framework callbacks share: building the monitor at train start without ever breaking training,
and finding the data-parallel wrapper the framework keeps to itself."""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import torch

from trainermon.config import ConfigError, load_config, read_env

logger = logging.getLogger("trainermon")


def check_config(config_file_path: str | os.PathLike) -> str:
    """Read the config once at the callback's construction, so that a bad one fails there, before
    training (raises `ConfigError` naming the key). In dynamic mode a file this node cannot read is left
    to `TrainerMon()` at train start, when the rank is known: a rank other than 0 then takes rank 0's
    config (node-local disks), rank 0 raises."""
    try:
        load_config(config_file_path)
    except ConfigError as exc:
        if not (read_env().dynamic and isinstance(exc.__cause__, OSError)):
            raise
    return str(config_file_path)


def ddp_wrapper_of(model: torch.nn.Module) -> torch.nn.Module:
    """The DistributedDataParallel that wraps `model`, else `model`. HF's `Trainer` hands its callbacks the
    unwrapped model; the monitor needs the wrapper to read gradients before DDP reduces them. Found once,
    among live objects, only when a process group exists (no DDP without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return model
    from torch.nn.parallel import DistributedDataParallel

    for obj in gc.get_objects():
        # type(), not isinstance(): some lazy module proxies warn when asked for __class__.
        if issubclass(type(obj), DistributedDataParallel) and obj.module is model:
            return obj
    return model


def start_monitor(config_file_path: str, model: Any, optimizer: Any, grad_acc_steps: int, step: int) -> Any:
    """A `TrainerMon` attached to `model` and `optimizer`, or None (logged as an error) when attaching
    fails: a monitoring problem never stops the training run."""
    from trainermon.api import TrainerMon

    monitor = None
    try:
        monitor = TrainerMon(config_file_path)
        monitor.set_monitor(model, grad_acc_steps=grad_acc_steps, optimizer=optimizer, start_iteration=step)
        return monitor
    except Exception:  # noqa: BLE001 - training goes on without the monitor
        logger.exception("trainermon: not attached; training continues without monitoring")
        if monitor is not None:
            monitor.close()
        return None
