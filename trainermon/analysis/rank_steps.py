"""Which steps each rank wrote `grad_reduced` rows for, and a note when a rank lacks steps others have.

The global gradient norm sums the rows a step has (`trends.global_grad_norm`): a parameter without a
gradient adds nothing, as in `clip_grad_norm_`. Rows never written look the same, so a rank killed
before its writer wrote its last steps (a tensor-parallel peer, a pipeline stage) makes those steps'
norm read low with nothing to show for it. Whole ranks missing from steps the other ranks have are
visible, though: this module keeps each rank's set of steps (ranks x steps integers; only the ranks
that write reduced gradients, one per data-parallel group) and says which steps a rank lacks.
"""

from __future__ import annotations

import numpy as np

#: The family whose per-rank steps are kept: the one the global norm sums.
FAMILY = "grad_reduced"
#: Missing steps named in a note (the count is always given).
SHOWN_STEPS = 6


class RankSteps:
    """Per rank, the distinct steps of its `grad_reduced` rows (fed batch by batch by `scan`)."""

    def __init__(self) -> None:
        self._steps: dict[int, set[int]] = {}

    def add(self, rank: int, steps: np.ndarray) -> None:
        self._steps.setdefault(int(rank), set()).update(np.unique(steps).tolist())

    def by_rank(self) -> dict[int, list[int]]:
        return {r: sorted(s) for r, s in self._steps.items()}


def missing_steps_note(steps_by_rank: dict[int, list[int]]) -> str | None:
    """A note naming the ranks that have no `grad_reduced` rows at steps where other ranks have some
    (None when every rank has every step, or with fewer than two ranks)."""
    if len(steps_by_rank) < 2:
        return None
    every = sorted(set().union(*map(set, steps_by_rank.values())))
    lines = []
    for rank in sorted(steps_by_rank):
        own = set(steps_by_rank[rank])
        missing = [s for s in every if s not in own]
        if not missing:
            continue
        shown = ", ".join(map(str, missing[:SHOWN_STEPS])) + (", ..." if len(missing) > SHOWN_STEPS else "")
        stop = f", after its last step {max(own)}" if min(missing) > max(own) else ""
        lines.append(f"rank {rank} has none at {len(missing)} of {len(every)} steps{stop} (steps {shown})")
    if not lines:
        return None
    return (
        f"{FAMILY} rows missing on some ranks at steps other ranks wrote: {'; '.join(lines)}. The global "
        "grad norm at those steps leaves that rank's tensors out and reads low when they had gradients "
        "(a rank killed before its writer wrote them, a sink that failed: its log says); it is right when "
        "none of them had a gradient (every expert a rank holds unused at that step)"
    )
