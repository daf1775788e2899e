"""Evaluation passes: a forward run in eval mode without grad (`model.eval()` + `torch.no_grad()`:
evaluation, `generate()`) between or inside training steps is not a micro-batch of the step. The actv
hooks (`activations`) skip such calls; `moe_load` and `attn_logit` apply the same rule here.

One exception: a reentrant activation checkpoint's first pass also runs without grad, in eval mode when the
model trains in eval mode (dropout off). It runs inside a root forward that began with grad on, which the
root hooks of `GradForward` see (as `ModuleHooks.grad_forward` does for the actv hooks)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from trainermon.copies import CopySafe

logger = logging.getLogger("trainermon")


def evaluation_pass(module: torch.nn.Module, grad_forward: bool) -> bool:
    """Whether `module`'s call is an evaluation pass: eval mode, grad off, and not inside a root forward
    that began with grad on (`grad_forward`). Two attribute reads and a C call."""
    return not module.training and not torch.is_grad_enabled() and not grad_forward


class _RootHook(CopySafe):
    """`CopySafe` with a `__call__` of its own: dynamo keeps one cache per code object, and the root hooks
    of every family sharing `CopySafe.__call__` tipped it over `recompile_limit` (a false-alarm warning)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)


class GradForward:
    """Whether a forward of the model's roots that began with grad on is running. Its two root hooks exist
    on collected steps only (`arm`): an uncollected step pays nothing; a collected one two Python calls per
    root forward."""

    __slots__ = ("on", "_handles", "_said", "_what")

    def __init__(self, what: str) -> None:
        self.on = False
        self._handles: list[Any] = []
        self._said = False
        self._what = what  # the family, for the one INFO line

    def arm(self, roots: Sequence[torch.nn.Module], wanted: bool) -> None:
        """At a step's beginning: the root hooks exist iff the family collects at this step."""
        if wanted and not self._handles:
            for root in roots:
                self._handles.append(root.register_forward_pre_hook(_RootHook(self._enter)))
                self._handles.append(root.register_forward_hook(_RootHook(self._leave), always_call=True))
        elif not wanted and self._handles:
            self.close()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self.on = torch.is_grad_enabled()

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling():
            self.on = False

    def skips(self, module: torch.nn.Module, name: str) -> bool:
        """Whether `module`'s call is an evaluation pass (`evaluation_pass`), said once at INFO."""
        if not evaluation_pass(module, self.on):
            return False
        if not self._said and not torch.compiler.is_compiling():  # no logging inside dynamo's trace
            self._said = True
            logger.info(
                "trainermon: %s ran in eval mode without grad (an evaluation pass): its calls are not "
                "counted in %s rows",
                name,
                self._what,
            )
        return True

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.on = False
