"""Modules that write their input in place (ReLU(inplace=True), `x.add_(b)`, Megatron's softmax masking
its scores): the gradient rows whose autograd nodes the write bypasses, served by the write's node.

Autograd rebases a view written in place: the write's `CopySlices` node sends the gradient of the base's
value before the write straight to the base's older node, and the view nodes in between (the writer's own
input view, views earlier modules returned) never see it. The forward hook finds the write's node
(`hook_written_input`) and hooks it for those rows (`WrittenRows`), summing with what a bypassed node
still gets from reads made before the write (`TwoPaths`)."""

from __future__ import annotations

from typing import Any

import torch

from .grad_rows import GradRows

_WRITE_NODE = "CopySlices"  # the node autograd makes for an in-place write into a view
_VIEW_ROWS = "trainermon.rows"  # Node.metadata key: a view's hooks, for a write that bypasses its node
# Whether the running backward will run (or has run) a node; absent: a bypassed node's read share and the
# write's share are written as two rows (see `TwoPaths`)
_will_run = getattr(torch._C, "_will_engine_execute_node", None)


def mark_view(node: Any, rows: GradRows, view: Any, handle: Any) -> None:
    """Notes on a hooked node whose tensor is a view (an output that is a view: a rebased in-place output,
    a transpose; an input that such an output aliases) its hook, the hook's handle and the view's place in
    its base: a later write into that base through another view bypasses the node (`hook_written_input`
    then serves the row). Node.metadata lives as long as the node; ~0.1 us."""
    node.metadata.setdefault(_VIEW_ROWS, []).append(
        (rows, (view.shape, view.stride(), view.storage_offset()), handle)
    )


class TwoPaths:
    """One row from the two paths a bypassed view's gradient takes. Reads of the view before the write
    (`y = o * 3`, then ReLU(inplace=True) on `o`) still reach its node; the write's share comes through
    the write's node. Each side, arriving, waits for the other if the engine will run it, else writes.

    It holds both nodes, and each node holds it as a hook: a cycle through C++ that Python's collector
    cannot see. The probe calls `release` at the next step's start, which breaks it."""

    __slots__ = ("rows", "node", "write", "part")

    def __init__(self, rows: GradRows, node: Any, write: Any) -> None:
        self.rows, self.node, self.write, self.part = rows, node, write, None

    def __call__(self, grad_outputs: tuple) -> None:  # the bypassed node's pre-hook: the reads' share
        self._arrive(grad_outputs[self.rows.index], self.write)

    def from_write(self, grad: Any) -> None:
        self._arrive(grad, self.node)

    def release(self) -> None:
        self.node = self.write = self.part = None

    def _arrive(self, grad: Any, other: Any) -> None:
        try:
            if self.part is not None:  # the other share came first: one row of the sum
                (part,), self.part = self.part, None
                grad = part if grad is None else grad if part is None else grad + part
            elif _will_run(other):
                self.part = (grad,)  # held by reference: the engine does not write into a grad it shares
                return
        except Exception as exc:  # noqa: BLE001
            self.rows.loop.faults.record("activation-gradient hook", exc)
            return
        self.rows((grad,))


class WrittenRows:
    """Gradient rows served by the node of an in-place write into a view (ReLU(inplace=True)).

    Autograd rebases a view written in place: the write's `CopySlices` node passes the gradient of the
    base's value before the write straight to the base's older node, laid out as the base, and the view
    nodes in between (the writer's input view, a view an earlier module returned) are bypassed. A
    post-hook of the write's node sees that gradient: each target (a `TwoPaths`, or a `GradRows` where the
    engine cannot be asked) gets its `region`, the tensor's place in the base (None: the whole base)."""

    __slots__ = ("targets",)

    def __init__(self, targets: list[tuple[Any, tuple | None]]) -> None:
        self.targets = targets

    def __call__(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        grad = grad_inputs[0]
        for target, region in self.targets:
            piece = grad
            if grad is not None and region is not None:
                try:
                    piece = grad.as_strided(*region)
                except Exception as exc:  # noqa: BLE001
                    target.rows.loop.faults.record("activation-gradient hook", exc)
                    continue
            if type(target) is TwoPaths:
                target.from_write(piece)
            else:
                target((piece,))


def release(made: list) -> None:
    """Releases a step's `TwoPaths` (see there) and empties `made`."""
    for two in made:
        two.release()
    made.clear()


def hook_written_input(loop: Any, view: Any, node: Any, rows: GradRows, handle: Any, made: list) -> None:
    """Moves the input-gradient hook of a module that wrote its input `view` in place (its version moved)
    to the write's node (see `WrittenRows`), with the hooks of the views the write bypasses: each
    bypassed node's hook is replaced by a `TwoPaths`, which sums its share with the write's (appended to
    `made`, for the probe to release).

    A walk of a few autograd nodes, no tensor work, run only for such modules. A layout the walk cannot
    place is logged once and counted, and those rows are not written."""
    before = []  # the nodes the view's value came from: its hooked node's chain, the base's old node on it
    fn = node
    for _ in range(16):
        nexts = fn.next_functions
        fn = nexts[0][0] if nexts else None
        if fn is None:
            break
        before.append(fn)
    base = view._base
    where = (base.shape, base.stride(), base.storage_offset())
    fn = base.grad_fn
    for _ in range(64):  # the base's nodes made since: one CopySlices per write into it, newest first
        if fn is None or type(fn).__name__ != _WRITE_NODE or not fn.next_functions:
            break
        older = fn.next_functions[0][0]
        found = next((i for i, b in enumerate(before) if b is older), None)
        if found is not None:
            bypassed = [(node, [(rows, (view.shape, view.stride(), view.storage_offset()), handle)])]
            bypassed += [(b, b.metadata.get(_VIEW_ROWS, ())) for b in before[:found]]
            targets: list[tuple[Any, tuple | None]] = []
            for passed, marks in bypassed:
                for marked, (shape, stride, offset), marked_handle in marks:
                    target: Any = marked
                    if _will_run is not None:
                        marked_handle.remove()
                        target = TwoPaths(marked, passed, fn)
                        passed.register_prehook(target)
                        made.append(target)
                    same = (shape, stride, offset) == where
                    targets.append((target, None if same else (shape, stride, offset - where[2])))
            fn.register_hook(WrittenRows(targets))
            return
        fn = older
    loop.faults.record(
        "in-place input write",
        RuntimeError(f"no autograd node found for the write into input rows {rows.labels}"),
        "their input-gradient rows are not written",
    )


def settle_input_views(loop: Any, bases: dict[int, tuple], aliased: bool, made: list) -> None:
    """After a forward, for each input view its pre-hook made (`ActivationProbe._hook_view` entries): a
    view the module wrote in place (its version moved) gets its hook moved to the write's node; when an
    output is a view (`aliased`: it may alias an input, as Flatten's does), the others are marked."""
    for tensor, version, view, node, rows, handle in bases.values():
        if tensor._version != version:
            hook_written_input(loop, view, node, rows, handle, made)
        elif aliased:
            mark_view(node, rows, view, handle)
