"""grad_unreduced and grad_reduced.

grad_unreduced comes from the adapter's pre-reduce taps during backward (always installed when weight
gradients may be collected, inert on other steps), or is read at the step where no tap exists; with
`monitor_mbs_grad`, per micro-batch from taps armed for the collected step only (numbered by the taps'
calls per parameter, or, inside a torch.distributed.pipelining stage's backward, by its schedule). Those
per-micro-batch rows are the gradients backward computes: under a loss scaler they carry its scale, as
actv_grad does (in plain PyTorch too, where the step rows are read after `scaler.step` unscaled them). Not
unscaled here: the scaler is first seen at its `step`/`unscale_`, after the first collected backward, and
keeping each micro-batch's gradient until then would cost a copy of the gradients per micro-batch.
grad_reduced is read when the reduced gradients are final (`grads_final`): before the user's gradient
clipping scales them where the adapter names its framework's clipping (`Adapter.clip_entries`, watched on
collected steps only), else at the optimizer's pre-step. Where no data-parallel reduction exists the two
are the same tensors, computed once.

`module_ranks` (msprobe's "ranks to monitor") gates grad_unreduced, a per-rank family: a rank not listed
arms no tap and writes no grad_unreduced row, and still reads grad_reduced (the job's one-writer rows,
whose merges every rank takes part in).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from trainermon.adapters.base import GRAD_REDUCED, GRAD_UNREDUCED, GradTaps
from trainermon.collect.placement import LOCAL, Local, TensorPiece
from trainermon.comm.pipe_passes import PIPE
from trainermon.config import MonitorConfig

from ..clip_watch import Watch, watch
from ..plan import StepPlan
from ..side_passes import SIDE_PASSES
from .base import Probe

logger = logging.getLogger("trainermon")

_UNSET = object()  # no clipping read the gradients yet this step


def _same_pieces(a: list, b: list) -> bool:
    """The two lists describe the very same tensors with the same placement."""
    return a is b or (
        len(a) == len(b)
        and all(
            (x is None and y is None)
            or (x is not None and y is not None and x.placement == y.placement and x.tensor is y.tensor)
            for x, y in zip(a, b)
        )
    )


def _own(grad: torch.Tensor, shard: str) -> TensorPiece:
    """This rank's own gradient, labelled when the rank holds a piece of the parameter."""
    return TensorPiece(grad, LOCAL, tuple(grad.shape), grad.dtype, shard)


class GradientProbe(Probe):
    def __init__(self, loop: Any) -> None:
        super().__init__(loop)
        self.taps = GradTaps(self._on_unreduced, self._on_microbatch)
        self._step_handles: list[Any] = []
        self._step_taps = GradTaps(self._on_unreduced, self._on_microbatch)  # this step's micro-batch taps
        self._said_untapped = False
        self._microbatch: dict[int, int] = {}  # parameter index -> micro-batches seen this step
        self._clipping: Watch | None = None  # the clipping functions, watched while a step reads gradients
        self._stamp: Any = _UNSET  # a gradient's (id, version) after this step's last clipping
        self._model_ids: tuple[Any, frozenset[int]] = (None, frozenset())  # (selection, its models' params)
        self._rows = True  # this rank writes grad_unreduced rows (`module_ranks`)

    def configure(self, config: MonitorConfig) -> None:
        """At attach and each reload: whether this rank is one `module_ranks` monitors (no per-step cost)."""
        self._rows = not config.module_ranks or self.loop.rank in config.module_ranks

    def attach(self) -> list[Any]:
        loop = self.loop
        if loop.config.wg_distribution or loop.control is not None:  # dynamic: wg may be switched on
            return loop.adapter.install_grad_taps(self.taps)
        return []

    def begin(self, plan: StepPlan) -> None:
        self._remove_step_taps()
        self._microbatch.clear()
        self._stamp = _UNSET
        # a rank outside module_ranks arms no tap: no per-parameter hook runs in its backward
        self.taps.active = plan.grads and not plan.microbatch_grads and self._rows
        self.loop.adapter.arm_grad_taps(self.taps.active)
        self._watch_clipping(plan.grads)
        if plan.microbatch_grads and self._rows:
            # This step's own taps object: a hook the adapter registered before failing (its handle lost
            # with the exception) reports to it, and it is switched off at the next boundary.
            self._step_taps = self._new_step_taps()
            self._step_handles += self.loop.adapter.install_microbatch_taps(
                self.loop.selection.params, self._step_taps
            )

    def _new_step_taps(self) -> GradTaps:
        """Taps that report micro-batch gradients while `active` (this step), and never after."""
        taps = GradTaps(self._on_unreduced, self._on_microbatch)

        def on_microbatch(index: int, grad: torch.Tensor) -> None:
            if taps.active:
                self._on_microbatch(index, grad)

        taps.on_microbatch = on_microbatch
        taps.active = True
        return taps

    def _remove_step_taps(self) -> None:
        self._step_taps.active = False
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()

    def _watch_clipping(self, on: bool) -> None:
        if on and self._clipping is None:
            entries = tuple(self.loop.adapter.clip_entries())
            if entries:
                self._clipping = watch(self, entries)
        elif not on and self._clipping is not None:
            self._clipping.remove()
            self._clipping = None

    def before_clipping(self, params: list | None, owner: Any) -> None:
        """Called by a clipping function, before it scales gradients: this step's gradients are read now
        if it clips this monitor's model (a loop with two models and two monitors clips each on its own).
        Read again, replacing the first read, when the gradients changed since the step's last clipping
        (a backward ran: an iteration dropped without `zero_grad()`, or clipping per micro-batch)."""
        loop = self.loop
        try:
            if loop.closed or not loop.plan.grads:
                return
            adapter = loop.adapter
            if owner is not None:  # a chunk, or a module inside one (an FSDP1 root held by the chunk)
                ours = id(owner) in self._ids_of_modules(adapter)
            else:
                ids = self._ids_of_models()
                ours = any(id(p) in ids for p in params or ())
            if ours:
                loop.on_grads_final(again=self._stamp is not _UNSET and self._stamp != self._grad_stamp())
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            loop.faults.record("gradient clipping", exc)

    def _ids_of_modules(self, adapter: Any) -> frozenset[int]:
        """The ids of every module of the model chunks, kept while the selection stands: one set lookup
        per clipping call."""
        selection, ids = getattr(self, "_module_ids", (None, frozenset()))
        if selection is not self.loop.selection:
            ids = frozenset(id(m) for chunk in adapter.chunks for m in chunk.modules())
            self._module_ids = (self.loop.selection, ids)
        return ids

    def after_clipping(self) -> None:
        try:
            if self.loop.plan.grads:
                self._stamp = self._grad_stamp()
        except Exception as exc:  # noqa: BLE001
            self.loop.faults.record("gradient clipping", exc)

    def _grad_stamp(self) -> tuple | None:
        """The first selected gradient's identity and in-place version: both stay while nothing but the
        clipping touches the gradients, and change with a backward (accumulated in place, or a new tensor
        after `p.grad = None`). None: no gradient yet (FSDP2 before the reducing micro-batch)."""
        for mp in self.loop.selection.params:
            grad = mp.param.grad
            if grad is not None:
                return id(grad), grad._version
        return None

    def _ids_of_models(self) -> frozenset[int]:
        """The ids of every parameter of the model chunks (what a user passes to the clipping), kept while
        the selection stands (a new trainable parameter makes a new selection)."""
        selection, ids = self._model_ids
        if selection is not self.loop.selection:
            adapter = self.loop.adapter
            models = {id(m): m for m in (*adapter.chunks, *adapter.roots())}.values()
            ids = frozenset(id(p) for m in models for p in m.parameters())
            ids |= {id(mp.param) for mp in adapter.parameters()}
            self._model_ids = (self.loop.selection, ids)
        return ids

    def grads_final(self, plan: StepPlan) -> None:
        self._stamp = _UNSET
        if not plan.grads:
            return
        loop, adapter, sel = self.loop, self.loop.adapter, self.loop.selection
        if not plan.microbatch_grads and adapter.single_replica():
            # No data-parallel reduction exists (plain PyTorch): one computation gives both families.
            if self._rows:
                loop.record_params("grad_unreduced", GRAD_REDUCED, also_as="grad_reduced")
            else:
                loop.record_params("grad_reduced", GRAD_REDUCED)
            return
        if plan.microbatch_grads or adapter.taps_report_unreduced:
            adapter.report_held_unreduced()
            loop.record_params("grad_reduced", GRAD_REDUCED)  # grad_unreduced: reported by taps
            if plan.microbatch_grads:
                self._say_untapped()
            return
        reduced = adapter.read(GRAD_REDUCED, sel.params)
        unreduced = adapter.read(GRAD_UNREDUCED, sel.params)
        if not self._rows:
            # pieces merged over ranks (a sharded placement) stay: every rank takes part in their merge
            unreduced = [None if p is None or type(p.placement) is Local else p for p in unreduced]
            if not any(p is not None for p in unreduced):
                loop.record("grad_reduced", sel.entries(reduced))
                return
        elif _same_pieces(unreduced, reduced):  # no reduction happened: one computation, both families
            loop.record("grad_unreduced", sel.entries(unreduced), also_as="grad_reduced")
            return
        loop.record("grad_unreduced", sel.entries(unreduced))
        loop.record("grad_reduced", sel.entries(reduced))

    def _say_untapped(self) -> None:
        """Once: parameters frozen at the step boundary, trainable and with a gradient now, whose tap
        never went in (their module's forward ran no hook: a compiled model ignores hooks added after it
        was compiled; or they are used outside their module): their micro-batch rows are missing."""
        if self._said_untapped:
            return
        missed = [
            mp.name
            for handle in self._step_handles
            for waiting in getattr(handle, "waiting", ())
            for mp in waiting
            if mp.param.requires_grad and mp.param.grad is not None
        ]
        if missed:
            self._said_untapped = True
            logger.warning(
                "trainermon: step %d: %s were frozen when the step began and trained in it, but no forward "
                "of their module ran trainermon's hook (a compiled model ignores hooks added after it was "
                "compiled, or they are used outside their module): their micro-batch grad_unreduced rows "
                "are missing at such steps (said once)",
                self.loop.step,
                ", ".join(missed[:8]) + (f" and {len(missed) - 8} more" if len(missed) > 8 else ""),
            )

    def close(self) -> None:
        self._watch_clipping(False)
        self._remove_step_taps()

    # ---- taps (called from backward) -----------------------------------------------------------
    def _on_unreduced(self, indices: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
        loop = self.loop
        try:
            sel = loop.selection
            entries = []
            for index, grad in zip(indices, grads):
                pos = sel.position.get(index)
                if pos is not None:
                    mp = sel.params[pos]
                    entries.append((mp.vpp_stage, sel.names[pos], None, _own(grad, mp.local_shard)))
            if entries:
                loop.record("grad_unreduced", entries)
        except Exception as exc:  # noqa: BLE001
            loop.faults.record("grad_unreduced tap", exc)

    def _on_microbatch(self, index: int, grad: torch.Tensor) -> None:
        loop = self.loop
        try:
            sel = loop.selection
            pos = sel.position.get(index)
            if pos is None or not loop.plan.collecting or SIDE_PASSES.depth:  # a framework's own pass
                return
            micro = self._microbatch.get(index, 0)
            self._microbatch[index] = micro + 1
            if PIPE.backward is not None:  # a pipeline stage's backward: its schedule numbers it (LoopedBFS
                micro = PIPE.backward  # runs them in reverse, where hooks' order would number them wrongly)
            mp = sel.params[pos]
            loop.record("grad_unreduced", [(mp.vpp_stage, sel.names[pos], micro, _own(grad, mp.local_shard))])
        except Exception as exc:  # noqa: BLE001
            loop.faults.record("micro-batch gradient tap", exc)
