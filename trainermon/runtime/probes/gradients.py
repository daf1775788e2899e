"""grad_unreduced and grad_reduced.

grad_unreduced comes from the adapter's pre-reduce taps during backward (always installed when weight
gradients may be collected, inert on other steps), or is read at the step where no tap exists; with
`monitor_mbs_grad`, per micro-batch from taps armed for the collected step only. grad_reduced is read
when the reduced gradients are ready (`pre_optim`). Where no data-parallel reduction exists the two are the
same tensors, computed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainermon.adapters.base import GRAD_REDUCED, GRAD_UNREDUCED, GradTaps
from trainermon.collect.placement import LOCAL, TensorPiece

from ..plan import StepPlan
from .base import Probe


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
        self._microbatch: dict[int, int] = {}  # parameter index -> micro-batches seen this step

    def attach(self) -> list[Any]:
        loop = self.loop
        if loop.config.wg_distribution or loop.control is not None:  # dynamic: wg may be switched on
            return loop.adapter.install_grad_taps(self.taps)
        return []

    def begin(self, plan: StepPlan) -> None:
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()
        self._microbatch.clear()
        self.taps.active = plan.grads and not plan.microbatch_grads
        self.loop.adapter.arm_grad_taps(self.taps.active)
        if plan.microbatch_grads:
            self._step_handles += self.loop.adapter.install_microbatch_taps(
                self.loop.selection.params, self.taps
            )

    def pre_optim(self, plan: StepPlan) -> None:
        if not plan.grads:
            return
        loop, adapter, sel = self.loop, self.loop.adapter, self.loop.selection
        if not plan.microbatch_grads and adapter.single_replica():
            # No data-parallel reduction exists (plain PyTorch): one computation gives both families.
            loop.record_params("grad_unreduced", GRAD_REDUCED, also_as="grad_reduced")
            return
        if plan.microbatch_grads or adapter.taps_report_unreduced:
            loop.record_params("grad_reduced", GRAD_REDUCED)  # grad_unreduced: reported by taps
            return
        reduced = adapter.read(GRAD_REDUCED, sel.params)
        unreduced = adapter.read(GRAD_UNREDUCED, sel.params)
        if _same_pieces(unreduced, reduced):  # no reduction happened: one computation, both families
            loop.record("grad_unreduced", sel.entries(unreduced), also_as="grad_reduced")
            return
        loop.record("grad_unreduced", sel.entries(unreduced))
        loop.record("grad_reduced", sel.entries(reduced))

    def close(self) -> None:
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()

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
            if pos is None or not loop.plan.collecting:
                return
            micro = self._microbatch.get(index, 0)
            self._microbatch[index] = micro + 1
            mp = sel.params[pos]
            loop.record("grad_unreduced", [(mp.vpp_stage, sel.names[pos], micro, _own(grad, mp.local_shard))])
        except Exception as exc:  # noqa: BLE001
            loop.faults.record("micro-batch gradient tap", exc)
