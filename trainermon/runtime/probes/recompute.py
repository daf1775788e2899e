"""Micro-steps of the forwards that reentrant activation checkpointing recomputes.

Under reentrant checkpointing (`use_reentrant=True`) a region's first forward runs without grad, so its
outputs never see a gradient. Backward recomputes the region, with grad, inside the region's own autograd
node, and the probe hooks the recomputed tensors instead, with the first forward's micro-steps.

Which first forward a recomputed call repeats: backward recomputes the regions last first, and replays
each region's calls in forward order. So a module called k times in one region takes, in order, the last
k micro-steps of its first forwards not taken yet. k is known once the region's recompute is over, which is
before any of its gradients flows (the region's backward starts after its recompute), so the hooks made
during a recompute get their micro-step then (`LateGradRows`). A recompute is told from the next by its
autograd node (`torch._C._current_autograd_node`).
"""

from __future__ import annotations

from typing import Any

import torch

from .grad_rows import GradRows


class LateGradRows(GradRows):
    """A `GradRows` made during a recompute, whose micro-step is set when the recompute is over."""

    __slots__ = ("recomputes",)

    def __call__(self, grad_outputs: tuple) -> None:
        if self.micro is None:
            self.recomputes.settle()
        if self.micro is not None:
            super().__call__(grad_outputs)


class Call:
    """One recomputed call of a module, and the hooks made for it."""

    __slots__ = ("key", "rows")

    def __init__(self, key: int) -> None:
        self.key, self.rows = key, []


class Recomputes:
    """The first forwards run without grad, per module, and the calls of the recompute under way.

    Costs nothing unless reentrant checkpointing runs; then a few dict operations per recomputed call."""

    __slots__ = ("loop", "first", "node", "calls", "open")

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.first: dict[int, list[int]] = {}  # module id -> micro-steps of its forwards run without grad
        self.node: Any = None  # the autograd node whose recompute `calls` belong to
        self.calls: list[Call] = []
        self.open: dict[int, list[Call]] = {}  # module id -> calls between its pre-hook and forward hook

    def first_pass(self, key: int, micro: int) -> None:
        self.first.setdefault(key, []).append(micro)

    def waiting(self, key: int) -> bool:
        """Whether a forward of this module ran without grad and has not been matched to a recompute."""
        return bool(self.first.get(key))

    def enter(self, key: int) -> Call:
        """The pre-hook of a recomputed call: its `Call`, which the forward hook then takes (`leave`)."""
        call = self._new(key)
        self.open.setdefault(key, []).append(call)
        return call

    def leave(self, key: int) -> Call:
        stack = self.open.get(key)
        return stack.pop() if stack else self._new(key)

    def rows(self, call: Call, vpp_stage: int, labels: tuple[str, ...], piece: str, index: int) -> GradRows:
        rows = LateGradRows(self.loop, vpp_stage, labels, None, piece, index)
        rows.recomputes = self
        call.rows.append(rows)
        return rows

    def _new(self, key: int) -> Call:
        node = torch._C._current_autograd_node()
        if node is not self.node:  # another region's recompute: the previous one is over
            self.settle()
            self.node = node
        call = Call(key)
        self.calls.append(call)
        return call

    def settle(self) -> None:
        """Gives the calls of the recompute under way their micro-steps (see the module docstring). A call
        without a first forward left (a recompute that ran a module more often than the first pass did)
        keeps none: its hooks write nothing, and that is logged once and counted."""
        by_module: dict[int, list[Call]] = {}
        for call in self.calls:
            by_module.setdefault(call.key, []).append(call)
        for key, calls in by_module.items():
            first = self.first.get(key, [])
            taken = first[max(0, len(first) - len(calls)) :]
            del first[len(first) - len(taken) :]
            for call, micro in zip(calls[len(calls) - len(taken) :], taken):
                for rows in call.rows:
                    rows.micro = micro
            if len(taken) < len(calls):
                self.loop.faults.record(
                    "checkpoint recompute",
                    RuntimeError(
                        f"{len(calls)} recomputed calls of a module whose first pass ran {len(taken)}"
                    ),
                    "the extra calls' actv_grad rows are not written",
                )
        self.calls = []
        self.node = None

    def clear(self) -> None:
        self.first.clear()
        self.calls = []
        self.open.clear()
        self.node = None
