"""actv_grad rows: the hook on the autograd node that makes a hooked activation, kept across steps."""

from __future__ import annotations

from typing import Any

from ..side_passes import SIDE_PASSES


class GradRows:
    """The hook on the autograd node that makes one tensor, seeing its gradient: one row per label (one
    tensor passed as several inputs: one row each, computed once). The gradient of a piece of a tensor is
    the same piece of its gradient: `piece` labels both.

    Kept across steps (`GradRowsCache`): one per hooked slot, not one per hooked tensor per step.

    A pre-hook of the node (`grad_fn.register_prehook`), given the gradients of all its outputs, of which
    `index` (the tensor's `output_nr`) is ours: the same gradient a tensor hook would get, also when the
    tensor is changed in place after the hook (the node that made its old value keeps the hook), for
    ~1 us less per hooked tensor than `Tensor.register_hook`, which builds a hook dict and a handle. An
    object with slots rather than a closure: a closure with its cells is seven objects for the garbage
    collector (see `collect.records.RowMetaCache` for why few objects matter).

    A zero-bubble schedule's weight pass (`side_passes.replay`) runs again the nodes where its input pass
    met the parameters' subgraphs: a hook that ran in the input pass (`ran`) writes no second row there,
    and one on a node only the weight pass reaches (an output made from parameters alone) writes its
    row then. `ran` stays set on nodes that are never replayed: only a replay reads it."""

    __slots__ = ("loop", "vpp_stage", "labels", "micro", "piece", "index", "ran")

    def __init__(
        self, loop: Any, vpp_stage: int, labels: tuple[str, ...], micro: int, piece: str, index: int
    ) -> None:
        self.loop, self.vpp_stage, self.labels, self.micro, self.piece = loop, vpp_stage, labels, micro, piece
        self.index, self.ran = index, False

    def __call__(self, grad_outputs: tuple) -> None:
        if SIDE_PASSES.replays:
            if self.ran:  # its row was written by the micro-batch's input pass
                self.ran = False
                return
        else:
            self.ran = True
        loop = self.loop
        with loop.clock:
            try:
                grad = grad_outputs[self.index]
                if loop.plan.collecting and grad is not None:
                    n = len(self.labels)
                    loop.record_local(
                        "actv_grad", self.vpp_stage, self.labels, self.micro, (grad,) * n, (self.piece,) * n
                    )
            except Exception as exc:  # noqa: BLE001
                loop.faults.record("activation-gradient hook", exc)


class GradRowsCache:
    """One `GradRows` per (vpp_stage, labels, micro_step, piece, output index), kept across steps. A hook
    made per hooked tensor lived from the forward to the backward: on (c), 816 objects per step alive
    when a young collection ran, promoted, and bringing CPython's next full collection (~140 ms) closer.
    Bounded: emptied when it holds LIMIT hooks (its keys hold no shapes, so it stays small; a hook already
    registered keeps working: the node holds it)."""

    LIMIT = 1 << 15

    __slots__ = ("loop", "hooks")

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.hooks: dict[tuple, GradRows] = {}

    def get(self, vpp_stage: int, labels: tuple[str, ...], micro: int, piece: str, index: int) -> GradRows:
        key = (vpp_stage, labels, micro, piece, index)
        hook = self.hooks.get(key)
        if hook is None:
            if len(self.hooks) >= self.LIMIT:
                self.hooks.clear()
            hook = self.hooks[key] = GradRows(self.loop, vpp_stage, labels, micro, piece, index)
        return hook
