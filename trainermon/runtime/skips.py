"""Iterations whose optimizer update was skipped (a loss scaler found Inf/NaN gradients).

`torch.amp.GradScaler.step(optimizer)` does not call `optimizer.step()` when the gradients overflow, so
the optimizer's step hooks never fire and, left alone, the monitor would merge that iteration into the
next one. This probe closes such an iteration as its own step, flagged `update_skipped`, at the next
`zero_grad()` of the optimizer or of a model root: a backward has reached the optimizer's parameters
since the last step boundary (a post-accumulate-grad hook on its first and last parameter sets a flag),
yet no optimizer step came. That is where every loop clears gradients before the
next iteration, whether it calls `zero_grad()` right after `scaler.step`/`scaler.update` or at the top
of the next iteration, and it needs neither the scaler object nor its private state.

The step counter therefore stays the training loop's iteration counter: one step per `scaler.step()`
call, whether or not it updated. The skipped step's activations, `actv_grad`, `grad_unreduced` (as seen
in backward: multiplied by the loss scale, like `actv_grad`) and `grad_reduced` (read at the boundary:
unscaled by `scaler.step`, with its Inf/NaN) are written; its parameters are unchanged.

A `zero_grad()` after a backward with no step is not always a skipped step: a GAN's generator loss is
backpropagated through the monitored discriminator and cleared, FGSM adversarial training clears the
attack's gradient, SAM's `first_step` clears the first gradient (inside `step()` for its closure form).
So the probe closes a skipped step only on evidence: a loss scaler's (`skip_evidence`), or a non-finite
gradient of the optimizer's first or last parameter (a loop skipping its own step on NaN: `own_skip`),
read then and only then (two norms and one host read, a device sync on an accelerator, at such a
`zero_grad()`: a loop whose every backward has its step never pays it; a GAN's or FGSM's pays it each
iteration). Otherwise those gradients were part of no step: nothing is closed, and that backward's
`actv_grad` and per-micro-batch `grad_unreduced` rows stay among the next step's micro-steps; the rows
DDP's taps took from it are taken out (`_unused`), so the step's own reduce is its `grad_unreduced`.
Non-finite gradients are no step either when a scaler's `unscale_` of another optimizer found Inf/NaN
after that backward and ours was not unscaled since (one scaler for a GAN's two optimizers: G's overflow
reaches D's gradients through G's loss). Another optimizer stepping the monitored parameters many times
with no step of ours between, once ours has stepped (ours replaced mid-run), is warned about once
(`_foreign`; a GAN's n_critic discriminator steps per generator step are no such thing). A
`zero_grad()` inside this optimizer's `step()` (a closure's, LBFGS; SAM's `first_step`) is part of the
step. A `step()` that began (a global step pre-hook saw it) but whose post-hooks never came (it, or a hook
of it, raised) is still its step, closed at the next `zero_grad()`: flagged skipped unless its update
returned (torch's step wrapper then calls `_optimizer_step_code`, watched on the instance).

A framework that sees every optimizer step call, updated or skipped (Lightning's `on_before_optimizer_step`,
which its precision plugins call before `scaler.step`), can say so (`report_step_calls`): then only a
`zero_grad()` after such a call closes a skipped step. A `zero_grad()` in the middle of an accumulation is
not a skip: Lightning clears the gradients before validation even there under manual optimization.

Which skips a loss scaler explains (the scaler at work) and which are the loop's own (`own_skip`): see
`skip_evidence`, the mixin that holds that evidence.

A fused optimizer (`fused=True`: `_step_supports_amp_scaling`) is always stepped by the scaler and skips
the update inside its kernel; its step hooks fire, so no probe closes anything: the optimizer step
reports the scaler's `found_inf` instead (`adapters.common`), read by the worker.

Megatron's and DeepSpeed's optimizers report a skip themselves (`update_skipped` from their step, an
overflow of their loss scaler: never `own_skip`); this probe is for torch optimizers only.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from trainermon.adapters.common import FOREIGN_STEPPED, Handles, Restore, with_wrapped_closure
from trainermon.adapters.state_init import late, maybe, state_init_step
from trainermon.adapters.wrapped import _STEP_WRAPPER, hookable, nested_step
from trainermon.collect.records import StepScalars
from trainermon.copies import CopySafe

from .global_hooks import global_step_hooks
from .lifecycle import weak_method
from .plan import StepPlan
from .probes.base import Probe
from .scaler_watch import ScalerWatch
from .skip_evidence import SkipEvidence

logger = logging.getLogger("trainermon")

#: Adapters whose step is a torch optimizer's, which GradScaler / ShardedGradScaler may skip.
SCALER_ADAPTERS = ("torch", "fsdp1", "fsdp2")


# Steps of other optimizers over monitored parameters, none of ours between, that say ours was replaced
FOREIGN_STEPS = 16


class SkippedStepProbe(SkipEvidence, Probe):
    def __init__(self, loop: Any) -> None:
        super().__init__(loop)
        self.trained = False  # a backward reached the optimizer's parameters since the last boundary
        self.calls_reported = False  # the framework calls `step_called` for each step call (see above)
        self.called = False  # ... and did since the last boundary
        self.wired = False  # attached to a torch optimizer
        self.in_step = False  # a step()'s closure is running: its zero_grad() is no skip (LBFGS)
        self.attempted = False  # the optimizer's step() began since the last boundary (global pre-hook)
        self.updated = False  # ... and its update returned (before its post-hooks)
        self.proxy: Any = None  # an optimizer sharing its param_groups, stepping them now (see _began)
        self.lazy: list[Any] = []  # parameters to hook once materialized (nn.LazyLinear)
        self.watched: list[Any] = []  # ... and those hooked: the ones whose gradients `_nonfinite` reads
        self.hooks = Handles()
        self.scaled = False  # a loss scaler's step() was called on the optimizer since the last boundary
        self.found_inf: list[Any] = []  # ... or its unscale_(): the scaler's found_inf tensors
        self.others_inf: list[
            Any
        ] = []  # found_inf of a scaler's unscale_ of another optimizer since backward
        self.foreign = 0  # steps of another optimizer holding monitored parameters since the boundary
        self.most_foreign = 0  # ... the most seen between two boundaries (a GAN's n_critic)
        self.ours_stepped = False  # the monitored optimizer's step() began once
        self.said_foreign = False
        self.holders: Any = weakref.WeakKeyDictionary()  # optimizer -> (its group count, holds ours)
        # id(optimizer) -> (weakref to it, its group count): another optimizer holding none of ours
        self.idle: dict[int, tuple[Any, int]] = {}

    def attach(self) -> list[Any]:
        adapter = self.loop.adapter
        optimizer = getattr(adapter, "optimizer", None)
        if adapter.name not in SCALER_ADAPTERS or not isinstance(optimizer, torch.optim.Optimizer):
            return []  # framework optimizers report skips themselves; no optimizer: TrainerMon.step()
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        # Two parameters, in case one is unused in some iteration: one flag per backward, the whole
        # cost on steps that are not collected. A lazy one (uninitialized) is hooked once it exists.
        self.lazy = list({id(q): q for q in (params[:1] + params[-1:])}.values())
        self._hook_materialized()
        handles: list[Any] = [self.hooks]
        # The user may clear gradients through the wrapper (DDP, FSDP) or the model inside it.
        modules = {id(m): m for m in (*adapter.chunks, *adapter.roots())}
        handles += [self._patch(m) for m in modules.values()]
        handles.append(self._patch(optimizer))
        if hookable(optimizer):  # marks the closure's run, not step(): a step that raises has no post hook
            mark = torch.compiler.disable(self._mark_closure)  # never traced: see hook_optimizer_step
            handles.append(optimizer.register_step_pre_hook(CopySafe(mark)))
            # Global pre-hooks run before any instance's: a step() whose own hooks raise still began
            handles += global_step_hooks(self)
            if callable(getattr(optimizer, "_optimizer_step_code", None)):
                handles.append(self._patch_updated(optimizer))
        handles.append(ScalerWatch(self))
        spans = getattr(adapter, "row_spans", None)
        if spans is not None:  # DDP's taps: rows of gradients cleared unused are taken out (`_unused`)
            spans.mark = self._rows_mark
            handles.append(_Unset(spans, "mark"))
        self.wired = True
        return handles

    def watch_zero_grad(self, obj: Any) -> Restore:
        """Also watch `obj.zero_grad()`: a wrapper whose own `zero_grad` bypasses the optimizer's
        (Lightning's `LightningOptimizer` runs `Optimizer.zero_grad` on itself). Undo with `.remove()`."""
        return self._patch(obj)

    def begin(self, plan: StepPlan) -> None:
        self.trained = self.called = self.in_step = self.scaled = self.attempted = self.updated = False
        self.proxy = None
        self.found_inf = []
        self.others_inf = []
        self.most_foreign = max(self.most_foreign, self.foreign)
        self.foreign = 0
        FOREIGN_STEPPED[0] = 0
        if self.lazy:  # an empty-list check a step once all are hooked
            self._hook_materialized()

    def _hook_materialized(self) -> None:
        """Hook the pending parameters that are no longer lazy (a lazy module's first forward made them)."""
        try:
            ready = [p for p in self.lazy if not is_lazy(p)]
            self.lazy = [p for p in self.lazy if is_lazy(p)]
            # Weakly: torch keeps a parameter's hooks in C++ too, a reference the garbage collector cannot
            # see, so a strong one would keep the model and this monitor alive forever once dropped.
            backward = weak_method(self._backward)
            self.hooks.items += [p.register_post_accumulate_grad_hook(backward) for p in ready]
            self.watched += ready
        except Exception as exc:  # noqa: BLE001 - skips are then not seen; training goes on
            self.lazy = []
            self.loop.faults.record("skipped-step hooks", exc)

    def step_called(self, optimizer: Any) -> None:
        """The framework is about to step `optimizer` (or a wrapper of it): the scaler may skip it."""
        if self._ours(optimizer):
            self.called = True

    def _ours(self, optimizer: Any) -> bool:
        """`optimizer` is the monitored optimizer or a short chain of wrappers around it."""
        target = getattr(self.loop.adapter, "optimizer", None)
        for _ in range(8):  # a short chain of wrappers (LightningOptimizer, AcceleratedOptimizer)
            if optimizer is None or optimizer is target:
                break
            optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        return optimizer is not None and optimizer is target

    def _mark_closure(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """torch's step pre-hook: the step's closure runs with `in_step` set, so its zero_grad() is no
        skipped step."""
        if nested_step(optimizer):
            return None  # the outer step()'s hook marked the closure already

        def marked(closure: Any) -> Any:
            def run(*a: Any, **k: Any) -> Any:
                self.in_step = True
                try:
                    return closure(*a, **k)
                finally:
                    self.in_step = False

            return run

        return with_wrapped_closure(args, kwargs, marked)

    def _began(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """Global step pre-hook: ours began (not DCP making its state: `state_init`). Or an optimizer
        that shares its very `param_groups` list (SAM's `base_optimizer`, stepped by `second_step()`
        without the monitored SAM's `step()`) steps them outside ours: that is this optimizer's step."""
        target = getattr(self.loop.adapter, "optimizer", None)
        if optimizer is target:
            if not ((maybe[0] or (late[0] and not optimizer.state)) and state_init_step(optimizer)):
                self.attempted = self.ours_stepped = True
        elif (
            getattr(optimizer, "param_groups", None) is getattr(target, "param_groups", False)
            and not self.attempted
            and not self.calls_reported
            and self.loop.hooked
            and not self.loop.closed
            and not nested_step(optimizer)
        ):
            self.attempted = True  # a raise in it: closed at the next zero_grad(), as ours
            self.proxy = optimizer
            try:
                self.loop.on_pre_optim()
            except Exception as exc:  # noqa: BLE001 - never into the training loop
                self.loop.faults.record("optimizer pre-step", exc)
        elif not self.said_foreign and not self.attempted and self.loop.hooked and not self.loop.closed:
            self._foreign(optimizer)

    def _foreign(self, optimizer: Any) -> None:
        """Another optimizer steps. Ones holding monitored parameters stepping them `FOREIGN_STEPS` times,
        and more than twice the most seen between two boundaries, with no step of ours since ours stepped,
        is most likely ours replaced (`opt = Adam(model.parameters())` mid-run): the monitor follows the
        optimizer given to set_monitor and would stay silent. A GAN's critic stepping n_critic times per
        generator step (WGAN: 5), before the first generator step too, is not; nor an inner loop's
        optimizer over our parameters (Reptile, lookahead) stepping a few times before ours. Said once.
        Costs a weak-dict lookup per step of another optimizer; a scan of its parameters once per
        optimizer."""
        try:
            groups = optimizer.param_groups
            known = self.holders.get(optimizer)
            if known is None or known[0] != len(groups):
                ids = {id(mp.param) for mp in self.loop.adapter.parameters()}
                held = sum(id(p) in ids for g in groups for p in g["params"])
                self.holders[optimizer] = known = (len(groups), held)
                if not held and groups is not getattr(self.loop.adapter.optimizer, "param_groups", None):
                    self._idle(optimizer)
            if not known[1] or nested_step(optimizer):
                return
            self.foreign += 1
            FOREIGN_STEPPED[0] += 1  # a second reduce in this step is explained (`OncePerStep`)
            if self.ours_stepped and self.foreign >= max(FOREIGN_STEPS, 2 * self.most_foreign + 1):
                self.said_foreign = True
                logger.warning(
                    "trainermon: optimizer %s (not the one given to set_monitor) steps %d monitored "
                    "parameters, and the monitored optimizer has not stepped since step %d: the monitor "
                    "follows only the optimizer given to set_monitor (no rows while it does not step). If "
                    "the optimizer was replaced, call TrainerMon(config).set_monitor(model, "
                    "optimizer=<the new one>, start_iteration=%d) (it closes this monitor)",
                    type(optimizer).__name__,
                    known[1],
                    self.loop.step,
                    self.loop.step,
                )
        except Exception as exc:  # noqa: BLE001 - a diagnostic never reaches the training loop
            self.said_foreign = True
            self.loop.faults.record("foreign optimizer check", exc)

    def _idle(self, optimizer: Any) -> None:
        """`optimizer` holds no monitored parameter: its later steps cost one call (`global_step_hooks`)
        while its group count stays; the entry goes with it."""
        key, idle = id(optimizer), self.idle
        idle[key] = (weakref.ref(optimizer, lambda _ref: idle.pop(key, None)), len(optimizer.param_groups))

    def _ended(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """Global step post-hook: the end of a step `_began` took as ours."""
        if optimizer is self.proxy and not nested_step(optimizer):
            self.proxy = None
            try:
                self.loop.on_post_optim(StepScalars())
            except Exception as exc:  # noqa: BLE001 - never into the training loop
                self.loop.faults.record("optimizer post-step", exc)

    def _patch_updated(self, optimizer: Any) -> Restore:
        """torch's step wrapper calls `_optimizer_step_code()` (a no-op for profilers) once the update
        returned, before the post-hooks: one Python call a step says the update ran."""
        original = optimizer._optimizer_step_code

        def step_code() -> Any:
            if not (maybe[0] and state_init_step(optimizer)):
                self.updated = True
            return original()

        optimizer._optimizer_step_code = patched = CopySafe(step_code, original)
        return Restore(optimizer, "_optimizer_step_code", patched)

    def _backward(self, param: Any) -> None:
        self.trained = True
        if self.others_inf:  # another optimizer's overflow before this backward explains none of it
            self.others_inf = []

    def _patch(self, obj: Any) -> Restore:
        original = obj.zero_grad

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            if self.trained and not self.in_step and self.loop.hooked and not self.loop.closed:
                self._cleared()
            return original(*args, **kwargs)

        obj.zero_grad = patched = CopySafe(zero_grad, original)  # a copy of `obj` clears its own
        return Restore(obj, "zero_grad", patched)

    def _cleared(self) -> None:
        """A `zero_grad()` after a backward reached the optimizer's parameters, no step since the boundary:
        a skipped step (closed), a step that raised (closed), or gradients no step used (see above)."""
        try:
            if self.calls_reported:  # the framework says whether a step call came
                if self.called:
                    self._close(StepScalars(update_skipped=True, own_skip=not self._by_scaler()))
                return
            if self.attempted:
                if not self._inside_step():  # else: SAM's first_step, inside step()
                    if self.updated:  # a post-hook raised: the update ran
                        self._close(StepScalars())
                    else:  # it raised before its update: a skipped step
                        self._close(StepScalars(update_skipped=True, own_skip=not self._by_scaler()))
                return
            scaler = self._by_scaler()
            if (
                scaler
                or not self._alike_everywhere()
                or (self._nonfinite() and not self._others_overflowed())
            ):
                self._close(StepScalars(update_skipped=True, own_skip=not scaler))
            else:
                self._unused()
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            self.loop.faults.record("skipped step", exc)

    def _unused(self) -> None:
        """The gradients are cleared unused: no step (a GAN, FGSM). Rows DDP's taps took from them are
        taken out, so that the step's own reduce is recorded (`gradients_unused`; no tensor work)."""
        self.trained = False
        forget = getattr(self.loop.adapter, "gradients_unused", None)
        spans = forget() if forget is not None else []
        if not spans:
            return
        loop = self.loop
        with loop._lock:
            if loop._grads_read:  # read after them (a clipping): the rows of cleared gradients, read again
                spans.append(list(loop._grads_rows))
                loop._grads_read = False
            for start, end in sorted(spans, reverse=True):
                loop.collector.take_out(start, end)

    def _rows_mark(self) -> tuple:
        with self.loop._lock:
            return self.loop.collector.mark()

    def _inside_step(self) -> bool:
        """This optimizer's `step()` is on the stack (~3 us at 40 frames; only after it began and before
        its boundary: a zero_grad() inside it, or after it raised)."""
        if _STEP_WRAPPER is None:
            return True  # a torch without the wrapper: as before, no close
        optimizer = self.loop.adapter.optimizer
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is _STEP_WRAPPER and frame.f_locals.get("self") is optimizer:
                return True
            frame = frame.f_back
        return False

    def _close(self, scalars: StepScalars) -> None:
        self.trained = False
        self.loop.on_pre_optim()
        self.loop.on_post_optim(scalars)


class _Unset:
    """A handle that sets `obj.<name>` back to None."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name

    def remove(self) -> None:
        setattr(self.obj, self.name, None)


def report_step_calls(loop: Any) -> SkippedStepProbe | None:
    """Switch `loop`'s skip probe to reported step calls (the caller then calls its `step_called` before
    every optimizer step it attempts) and return it; None when the loop has none or it is not wired."""
    for probe in getattr(loop, "probes", ()):
        if isinstance(probe, SkippedStepProbe) and probe.wired:
            probe.calls_reported = True
            return probe
    return None
