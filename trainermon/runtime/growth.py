"""What a step's boundary checks of the parameters. Parameters that become trainable after `set_monitor`:
unfrozen (`requires_grad_(True)`), handed to the optimizer later with `add_param_group`, or of a module
added to the model (held by no optimizer too). At each
collected step's boundary the adapter is asked for them (a count of flags and its identity checks, a
rescan only when either changed); new ones join the selection under the config's targets, with one log
line. When the step's gradients are read (`grads_final`) the count and the module dicts' sizes are taken
again, and the adapter asked only when one changed or a parameter or module was set on a module since the
boundary (torch's global registration hooks): a parameter unfrozen, replaced or added during an iteration
has its rows from that iteration's step on. Under DDP new ones have no pre-reduce tap (DDP itself only
reduces the parameters that were trainable when it was built).

In manual mode (`TrainerMon.step()`), whether the gradients are still the last backward's (`ManualGrads`)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from trainermon.config import MonitorConfig

from .lifecycle import weak_global_hook, weak_method
from .plan import StepPlan
from .probes.base import Probe
from .selection import select_params
from .targets import TargetCheck

logger = logging.getLogger("trainermon")


class NewParamsProbe(Probe):
    """First among the probes: the others read `loop.selection` in their own `begin`. It also says when
    the configured targets select nothing (`targets.TargetCheck`), at attach and at each reload."""

    def __init__(self, loop) -> None:
        super().__init__(loop)
        self.targets = TargetCheck()
        self.registered = False  # a parameter was registered on a module since this step's boundary

    def configure(self, config: MonitorConfig) -> None:
        try:
            self.targets.check(self.loop.adapter, config)
            self.targets.check_switches(config, self.loop.world_size, self.loop.env.dynamic)
        except Exception as exc:  # noqa: BLE001 - a diagnostic never stops set_monitor or a reload
            self.loop.faults.record("target check", exc)

    def attach(self) -> list[Any]:
        # a parameter or module set on a module (`m.w = nn.Parameter(...)`, a LoRA merge, `seq.append(m)`)
        # after a step's boundary: one Python call per registration (model building; none in a plain step)
        return [
            weak_global_hook(register_module_parameter_registration_hook, self._registered),
            weak_global_hook(register_module_module_registration_hook, self._registered),
        ]

    def _registered(self, *_args: Any) -> None:
        self.registered = True

    def begin(self, plan: StepPlan) -> None:
        self.registered = False
        self._refresh(plan)

    def grads_final(self, plan: StepPlan) -> None:
        # Between begin and here: flags and add_param_group (an unfreeze during the iteration), counted, a
        # parameter or module registered, or a module's dicts grown or shrunk without a registration
        # (`Sequential.insert` writes `_modules` itself); else not the adapter's identity walk again.
        adapter = self.loop.adapter
        count = getattr(adapter, "_trainable_mark", None)
        if (
            plan.scheduled
            and count is not None
            and not self.registered
            and count() == adapter._mark
            and adapter.dicts_unchanged()
        ):
            return
        self._refresh(plan)

    def _refresh(self, plan: StepPlan) -> None:
        loop = self.loop
        if not plan.scheduled or loop.adapter is None:
            return
        new = loop.adapter.new_parameters()
        # re-mapped or dropped parameters (the adapter's own warning names them) shift the indices: the
        # selection is rebuilt, but only what is new is logged as such
        if new or getattr(loop.adapter, "replaced", False):
            loop.selection = select_params(loop.adapter, loop.config)
        if new:
            chosen = {id(mp) for mp in loop.selection.params}
            names = [mp.name for mp in new if id(mp) in chosen]
            logger.info(
                "trainermon: step %d: %d parameter(s) became trainable, %d monitored: %s",
                plan.step,
                len(new),
                len(names),
                ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""),
            )


class ManualGrads:
    """Manual mode (`TrainerMon.step()`): whether the gradients a step() reads are still the last
    backward's. Armed on collected steps with weight gradients only (nothing on other steps): a
    post-accumulate-grad hook on the first selected parameter (one Python call per backward) notes its
    gradient's identity and in-place version once the backward is over (a callback queued behind the
    engine's own, so a DDP reduce is in it). At step(): None there (`zero_grad(set_to_none=True)`), or
    written since (`zero_grad(set_to_none=False)`, a loss scaler's unscale_, an update writing into it)
    and then all zeros (one host read, that case only: a device sync on an accelerator) is cleared, when
    no selected parameter's gradient holds a nonzero value either (a zero gradient can be true: LoRA's A
    at step 0): one batched read over all of them (`torch._foreach_norm`, a host read per device), only
    when the watched one is all zeros."""

    def __init__(self, faults: Any) -> None:
        self.faults = faults
        self.param: Any = None  # held while armed only
        self.selection: Any = None  # ... and the selection, for the other gradients (rare path)
        self.handle: Any = None
        self.stamp: tuple | None = None  # (id, version) of its gradient after the last backward
        self.queued = False

    def arm(self, loop: Any) -> None:
        """At a collected step's boundary (after set_monitor, each step(), a state load); else a flag test."""
        if self.handle is not None or not loop.plan.grads or loop.hooked or loop.closed:
            return
        try:
            self.param = next((mp.param for mp in loop.selection.params if mp.param.requires_grad), None)
            self.selection = loop.selection
            if self.param is not None:
                self.stamp, self.queued = None, False
                self.handle = self.param.register_post_accumulate_grad_hook(weak_method(self._backward))
        except Exception as exc:  # noqa: BLE001 - unarmed: the step reads the gradients as they are
            self.param = self.handle = None
            self.faults.record("manual gradient watch", exc)

    def _backward(self, _param: Any) -> None:
        if not self.queued:
            self.queued = True
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._done))  # after DDP's own callback

    def _done(self) -> None:
        self.queued = False
        grad = None if self.param is None else self.param.grad
        self.stamp = None if grad is None else (id(grad), grad._version)

    def gone(self, judge: bool = True) -> str | None:
        """Disarm; with `judge`, "none" or "zeros" when the gradients were cleared after the last backward,
        else None (as it left them, changed but not zeros, or nothing to tell: no backward reached it)."""
        param, handle, stamp, selection = self.param, self.handle, self.stamp, self.selection
        self.param = self.handle = self.stamp = self.selection = None
        if handle is None:
            return None
        try:
            handle.remove()
            grad = param.grad
            if not judge or stamp is None or (grad is not None and (id(grad), grad._version) == stamp):
                return None
            if grad is None:
                return "none"
            if bool(grad.detach().any()) or _any_nonzero(selection):
                return None  # edited in place (a clip, a scaler), not cleared
            return "zeros"
        except Exception as exc:  # noqa: BLE001 - the step reads the gradients as they are
            self.faults.record("manual gradient watch", exc)
            return None


def _any_nonzero(selection: Any) -> bool:
    """Whether any selected parameter's gradient holds a nonzero (or non-finite) value: a max-abs per
    gradient (`_foreach_norm`, inf: no underflow of tiny values), stacked and read once per device."""
    grads = [mp.param.grad.detach() for mp in selection.params if mp.param.grad is not None]
    by_device: dict[Any, list[torch.Tensor]] = {}
    for norm in torch._foreach_norm(grads, float("inf")) if grads else ():
        by_device.setdefault(norm.device, []).append(norm.float())
    return any(bool(torch.stack(norms).ne(0).any()) for norms in by_device.values())
