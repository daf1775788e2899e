"""Runs of the model that a framework makes for itself, inside a training step but none of its
micro-batches: torch.distributed.pipelining's shape inference at a stage's first step. Adapters mark them
(`side_pass`); the hooks then record nothing and count no micro-step (`probes.module_hooks`).

Also backward passes that run again autograd nodes a backward of the same micro-batch already ran:
a zero-bubble schedule's "weight" pass (`stage_backward_weight`) starts from the nodes where the "input"
pass met the parameters' subgraphs, with the gradients that pass saved for them. Adapters mark it
(`replay`); an activation-gradient hook on such a node writes no second row (`probes.grad_rows`), while the
parameters' gradient hooks, which fire there for the first time, work as in any backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class _SidePasses:
    # Process-wide, not per thread: autograd runs a CUDA backward's hooks on its device threads, which a
    # thread-local mark set on the training thread would not reach.
    depth = 0  # side passes open
    replays = 0  # replaying backward passes open


SIDE_PASSES = _SidePasses()


@contextlib.contextmanager
def side_pass() -> Iterator[None]:
    """Mark what runs inside as a framework's own pass."""
    SIDE_PASSES.depth += 1
    try:
        yield
    finally:
        SIDE_PASSES.depth -= 1


@contextlib.contextmanager
def replay() -> Iterator[None]:
    """Mark the backward that runs inside as one that runs again nodes of an earlier backward."""
    SIDE_PASSES.replays += 1
    try:
        yield
    finally:
        SIDE_PASSES.replays -= 1
