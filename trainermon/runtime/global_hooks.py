"""torch's process-wide optimizer step hooks of the skipped-step probe (`skips.SkippedStepProbe`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .lifecycle import later


def global_step_hooks(probe: Any) -> list[Any]:
    """torch's global step pre- and post-hook (every optimizer's step in the process): `probe._began`
    and `probe._ended`, holding `probe` weakly (torch's registry must not keep a monitor dropped without
    close() alive; removed at the next `settle()` once it is collected). Returns their handles.

    Costs per step() of an optimizer `probe.idle` holds (found holding none of the monitored parameters):
    one Python call of ours per hook (a weak dereference, a dict lookup, a length). Of the monitored
    optimizer and others: two for the pre-hook (a third for another optimizer holding monitored
    parameters: `_foreign`), one for the post-hook unless a proxy steps (SAM)."""
    ref = weakref.ref(probe, lambda _ref: later(unregister))
    idle = probe.idle

    def began(optimizer: Any, args: tuple, kwargs: dict) -> None:
        target = ref()
        if target is None:
            return
        known = idle.get(id(optimizer))
        if known is None or known[0]() is not optimizer or known[1] != len(optimizer.param_groups):
            target._began(optimizer, args, kwargs)

    def ended(optimizer: Any, args: tuple, kwargs: dict) -> None:
        target = ref()
        if target is not None and target.proxy is not None:
            target._ended(optimizer, args, kwargs)

    disable = torch.compiler.disable  # never traced: see adapters.common.hook_optimizer_step
    handles = [
        register_optimizer_step_pre_hook(disable(began)),
        register_optimizer_step_post_hook(disable(ended)),
    ]

    def unregister() -> None:
        for handle in handles:
            handle.remove()

    return handles
