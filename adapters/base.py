"""The adapter interface: what the core needs to know about a framework, and nothing more.

Every adapter answers the same questions:
- which modules and parameters the user's model has, under their own names (`roots`, `parameters`);
- where the pre-reduce gradient can be seen (`install_grad_taps`, `unreduced_grads`,
  `install_microbatch_taps`);
- where the reduced gradient, the optimizer state and the parameter live, and which piece of each this
  rank holds (`reduced_grads`, `optimizer_state`, `param_values`: `TensorPiece`s with placements);
- which optimizer's steps advance the monitor's step (`step_optimizer`).
The core never imports a framework; adapters import theirs lazily.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainermon.placement import TensorPiece


@dataclass(frozen=True)
class MonitoredParam:
    index: int  # position in the adapter's parameter list; the key used by taps
    vpp_stage: int
    name: str  # the user's name, wrapper segments removed
    param: torch.nn.Parameter


class GradTaps:
    """Callbacks the core hands to an adapter for gradients seen during backward.

    `active` is a plain attribute so that an always-installed tap can return at once on steps that are
    not collected."""

    def __init__(
        self,
        on_unreduced: Callable[[Sequence[int], Sequence[torch.Tensor]], None],
        on_microbatch: Callable[[int, torch.Tensor], None],
    ) -> None:
        self.active = False
        self.on_unreduced = on_unreduced
        self.on_microbatch = on_microbatch


class Adapter(ABC):
    name: str = "base"

    def __init__(
        self, chunks: Sequence[torch.nn.Module], optimizer: Any, dp_group: Any, tp_group: Any
    ) -> None:
        self.chunks = list(chunks)
        self.optimizer = optimizer
        self.dp_group = dp_group
        self.tp_group = tp_group

    @classmethod
    @abstractmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        """True when this adapter handles these objects (checked by type, not by class name alone)."""

    @abstractmethod
    def roots(self) -> list[torch.nn.Module]:
        """The unwrapped model chunks; module names are relative to these (vpp_stage = index)."""

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        """Modules that only wrap another one (not reported as layers)."""
        return False

    @abstractmethod
    def parameters(self) -> list[MonitoredParam]:
        """Every trainable parameter, in model order, named as the user names it."""

    def step_optimizer(self) -> Any:
        """The object whose `step()` marks the end of a training step (None: the user calls step()).

        A torch optimizer, or any object with `register_step_pre_hook` / `register_step_post_hook` (an
        adapter may return a small stand-in to choose where in a framework's step the hooks run), or an
        object with a `step()` method, which is wrapped on that instance only."""
        return self.optimizer

    def grad_acc_steps(self, requested: int) -> int:
        return requested

    def install_grad_taps(self, taps: GradTaps) -> list[Any]:
        """Install always-on pre-reduce taps that call `taps.on_unreduced` during backward. Returns handles.
        The default installs none and reports unreduced gradients at the step's end instead."""
        return []

    @abstractmethod
    def unreduced_grads(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None] | None:
        """Pre-reduce gradients read at the optimizer step, or None when taps already reported them."""

    def single_replica(self) -> bool:
        """True when no data-parallel reduction exists (one replica): the pre- and post-reduce gradients
        are then the same tensors and the monitor computes them once, without asking for both lists."""
        return False

    def install_microbatch_taps(self, params: Sequence[MonitoredParam], taps: GradTaps) -> list[Any]:
        """Install taps (only for a collected step) that report each micro-batch's own gradient. The
        default is a tensor hook per parameter, which fires with each backward's gradient before it is
        accumulated into `.grad`; adapters whose parameters are flattened or sharded override it."""
        handles = []
        for mp in params:

            def hook(grad: torch.Tensor, index: int = mp.index) -> None:
                taps.on_microbatch(index, grad)

            handles.append(mp.param.register_hook(hook))
        return handles

    @abstractmethod
    def reduced_grads(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        """The gradient the optimizer will use, per parameter (None: no gradient this step)."""

    @abstractmethod
    def optimizer_state(self, params: Sequence[MonitoredParam], key: str) -> list[TensorPiece | None]:
        """Optimizer state tensor `key` (e.g. 'exp_avg') per parameter (None: absent)."""

    @abstractmethod
    def param_values(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        """The parameter values per parameter."""

    def new_step(self) -> None:  # noqa: B027 - optional hook
        """Called at every step boundary, before the next step's backward."""

    def extras(self) -> dict[str, float | torch.Tensor]:
        """Per-step scalars recorded beside grad_reduced (loss scale, clip coefficient, optimizer norm)."""
        return {}

    def post_step_extras(self) -> dict[str, float | torch.Tensor]:
        """Per-step scalars known only after the optimizer step (skipped step, the optimizer's norm)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Remove anything the adapter installed."""
