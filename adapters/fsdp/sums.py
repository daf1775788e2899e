"""grad_unreduced under FSDP when every micro-batch reduces (accumulation without a no-sync mode).

FSDP1 (sharded strategies) and FSDP2 free the unsharded gradient once it is reduce-scattered, so each
reduce's pre-reduce gradient is that micro-batch's own gradient. This rank's contribution to the step is
then the sum over the step's reduces. Under a no-sync mode there is one reduce (of the gradient FSDP
accumulated itself) and the sum is that one gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger("trainermon")

Report = Callable[[Sequence[int], Sequence[torch.Tensor]], None]


class ReduceSums:
    """The step's pre-reduce gradients per parameter index, reported once per step.

    Until a step reduces a parameter twice, each gradient is reported at its reduce (no copy: the common
    case of one reduce a step, or a no-sync mode, costs a set lookup per parameter). From the step after
    one that did, gradients are summed (a copy of the first, an in-place add of the others: one extra
    unsharded gradient per parameter held from its first reduce to the optimizer step, on collected steps
    only) and reported by `flush` when the core reads the step's gradients. The step that shows the
    repeat keeps its first reduce only (already reported), and says so once.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.summing = False
        self._sum_next = False
        self._seen: set[int] = set()
        self._sums: dict[int, torch.Tensor] = {}

    def add(self, indices: Sequence[int], grads: Sequence[torch.Tensor], report: Report) -> None:
        """Called from the gradient taps of a collected step, at each reduce."""
        if self.summing:
            with torch.no_grad():
                for index, grad in zip(indices, grads):
                    total = self._sums.get(index)
                    if total is None:
                        self._sums[index] = grad.detach().clone()
                    else:
                        total.add_(grad)
            return
        seen = self._seen
        new = [k for k, index in enumerate(indices) if index not in seen]
        if len(new) < len(indices) and not self._sum_next:
            self._sum_next = True
            logger.warning(
                "trainermon: %s reduced gradients more than once in one step (every micro-batch reduces: "
                "gradient accumulation without no_sync()/set_requires_gradient_sync(False), or FSDP2's "
                "set_requires_all_reduce(False)); grad_unreduced is the sum of each reduce's pre-reduce "
                "gradient from the next collected step on (one copy of the gradients kept until the "
                "optimizer step); this step's rows hold the first reduce only",
                self.what,
            )
        seen.update(indices[k] for k in new)
        if new:
            report([indices[k] for k in new], [grads[k] for k in new])

    def flush(self, report: Report) -> None:
        """Reports the summed gradients when the core reads the step's gradients; again if it reads them
        again (its first rows were taken out). A dict check when nothing was summed."""
        if self._sums:
            indices = list(self._sums)
            report(indices, [self._sums[i] for i in indices])

    def clear(self) -> None:
        """A new step: forgets what was seen and summed."""
        self._seen.clear()
        self._sums.clear()
        if self._sum_next:
            self.summing = True
