"""Selected activation modules that never ran forward: no actv/actv_grad row, said once after the first
collected step (and after each reload) by `ActivationProbe.post_optim`."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

logger = logging.getLogger("trainermon")


def _applied_functionally(module: torch.nn.Module) -> bool:
    # nn.MultiheadAttention keeps `out_proj` as a module (of this private class, used nowhere else in torch)
    # for its parameters, and applies its weights inside its own forward: by design it never runs
    return type(module) is NonDynamicallyQuantizableLinear


def unrun_modules(modules: list[tuple[int, str, Any]], calls: dict[int, int]) -> tuple[list[str], list[str]]:
    """The names of `modules` (vpp_stage, name, module) with no forward counted in `calls` (module id ->
    forwards this step), containers left out (an `nn.ModuleList` or `nn.ModuleDict` has no forward of its
    own: its members run instead): those that could have run, then nn.MultiheadAttention's `out_proj`s,
    which never do. One dict look-up per selected module."""
    unrun = [
        (name, module)
        for _, name, module in modules
        if id(module) not in calls and type(module).forward is not torch.nn.Module.forward
    ]
    return (
        [name for name, module in unrun if not _applied_functionally(module)],
        [name for name, module in unrun if _applied_functionally(module)],
    )


def _shown(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def warn_unrun(names: tuple[list[str], list[str]], total: int, step: int, targeted: bool) -> None:
    """Say the selected modules that ran no forward: those that could have (WARNING), and MultiheadAttention's
    `out_proj`s, at WARNING when the user's targets named modules, at INFO when every module is selected
    (every model with an nn.MultiheadAttention would warn, about a torch design nothing can change)."""
    unrun, functional = names
    if unrun:
        logger.warning(
            "trainermon: xy_distribution: %d of the %d selected modules ran no forward in training at step "
            "%d (the first collected step of this configuration): %s; they have no actv/actv_grad rows (not "
            "called by the model's forward, or only in eval/no_grad)",
            len(unrun),
            total,
            step,
            _shown(unrun),
        )
    if functional:
        logger.log(
            logging.WARNING if targeted else logging.INFO,
            "trainermon: xy_distribution: %s: nn.MultiheadAttention applies out_proj's weights inside its "
            "own forward, so out_proj never runs as a module and has no actv/actv_grad rows (the attention "
            "module's output_0 row is its output); its parameters' rows are written as usual",
            _shown(functional),
        )
