"""Runs of the model that a framework makes for itself, inside a training step but none of its
micro-batches: torch.distributed.pipelining's shape inference at a stage's first step. Adapters mark them
(`side_pass`); the hooks then record nothing and count no micro-step (`probes.module_hooks`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class _SidePasses:
    # Process-wide, not per thread: autograd runs a CUDA backward's hooks on its device threads, which a
    # thread-local mark set on the training thread would not reach.
    depth = 0  # side passes open


SIDE_PASSES = _SidePasses()


@contextlib.contextmanager
def side_pass() -> Iterator[None]:
    """Mark what runs inside as a framework's own pass."""
    SIDE_PASSES.depth += 1
    try:
        yield
    finally:
        SIDE_PASSES.depth -= 1
