"""Selected activation modules that never ran forward: no actv/actv_grad row, said once after the first
collected step (and after each reload) by `ActivationProbe.post_optim`."""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("trainermon")


def unrun_modules(modules: list[tuple[int, str, Any]], calls: dict[int, int]) -> list[str]:
    """The names of `modules` (vpp_stage, name, module) with no forward counted in `calls` (module id ->
    forwards this step), containers left out (an `nn.ModuleList` or `nn.ModuleDict` has no forward of its
    own: its members run instead). One dict look-up per selected module."""
    return [
        name
        for _, name, module in modules
        if id(module) not in calls and type(module).forward is not torch.nn.Module.forward
    ]


def warn_unrun(names: list[str], total: int, step: int) -> None:
    if names:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        logger.warning(
            "trainermon: xy_distribution: %d of the %d selected modules ran no forward in training at step "
            "%d (the first collected step of this configuration): %s; they have no actv/actv_grad rows (not "
            "called by the model's forward, or only in eval/no_grad)",
            len(names),
            total,
            step,
            shown,
        )
