"""Where hook rows wait for the step's end: the row table the native kernel writes at the hook, and hook
tensors recorded by reference and reduced together where it cannot read them (see
`StepCollector.add_local` and `flush`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from trainermon.stats.partials import NANS, NUM_PARTIALS

#: Bytes of hook tensors held by reference for one batched reduction (see `StepCollector.flush`): small
#: enough to stay within a CPU's L2 cache and to add little to peak memory, large enough that a narrow
#: model's hooks share a few engine calls instead of one each.
HOLD_BYTES = 2 << 20
#: The same for hook tensors on an accelerator, where there is no cache to stay within: each engine call
#: costs ~100-150 us of host time (kernel table, buffers, launches), and a GPU's activations are tens of
#: MiB each, so a 2 MiB hold meant one call per hook. 256 MiB (0.3% of an 80 GB card) took `all` on an
#: H200 from +27% to +16% on a 1.7e9-parameter GPT and from +300% to +122% on a 1.2e8 one (PERFORMANCE.md).
ACCELERATOR_HOLD_BYTES = 256 << 20  # the default of the config key `accelerator_hold_mib`
#: Tensors held by reference before a flush, whatever their size.
HOLD_COUNT = 256


class HookBatch:
    """Hook tensors recorded by reference until `flush` reduces them in one engine call."""

    __slots__ = ("tensors", "stamps", "trust", "result")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.stamps: list[tuple[int, int]] = []
        self.trust: list[tuple[str, str]] = []  # (family, label) of each tensor
        self.result: torch.Tensor | None = None


class RowTable:
    """Rows the native kernel wrote at their hook (`StatsEngine.kernel_row`): a float64 CPU table of
    [capacity, NUM_PARTIALS] that doubles when full; `TableRun`s refer to its rows."""

    __slots__ = ("result", "used", "capacity")

    def __init__(self, capacity: int = 256) -> None:
        with torch.inference_mode(False):  # made under inference_mode, no later call could write it
            self.result = torch.empty((capacity, NUM_PARTIALS), dtype=torch.float64)
        self.used = 0
        self.capacity = capacity  # len(self.result), kept: a tensor's len() is a Python-level call

    def write(self, engine: Any, t: torch.Tensor) -> int | None:
        """`t`'s row, written now by the engine's kernel (`StatsEngine.kernel_row`); None when the kernel
        cannot read `t` (nothing written)."""
        row = self.used
        if row == self.capacity:
            with torch.inference_mode(False):
                grown = torch.empty((2 * row, NUM_PARTIALS), dtype=torch.float64)
                grown[:row] = self.result
            self.result, self.capacity = grown, 2 * row
        if not engine.kernel_row(t, self.result, row):
            return None
        self.used = row + 1
        return row


class Span:
    """Rows [start, stop) of a batch's result: one entry of `_parts` for consecutive batched rows."""

    __slots__ = ("batch", "start", "stop")

    def __init__(self, batch: HookBatch, start: int, stop: int) -> None:
        self.batch, self.start, self.stop = batch, start, stop

    def values(self) -> torch.Tensor:
        return self.batch.result[self.start : self.stop]


class TableRun:
    """Consecutive rows of the step that live in the row table, at any of its rows (a tensor seen again
    reuses its row): one entry of `_parts`, one object however many rows (see `RowMetaCache` for why
    few objects matter)."""

    __slots__ = ("table", "rows")

    def __init__(self, table: RowTable, rows: list[int]) -> None:
        self.table, self.rows = table, rows

    def values(self) -> torch.Tensor:
        return self.table.result[self.rows]


def stamp_of(t: torch.Tensor) -> tuple[int, int]:
    """What changes when a tensor's values are replaced through autograd's view (an in-place op bumps the
    version counter shared by every view) or its memory is swapped (`.data = `, storage resized)."""
    return t._version, t.data_ptr()


def hold_limit(batch: HookBatch, cpu_bytes: int, accelerator_bytes: int) -> int:
    """Bytes a batch may hold before it is reduced: by the device of its tensors (one per batch)."""
    if not batch.tensors or batch.tensors[0].device.type == "cpu":
        return cpu_bytes
    return accelerator_bytes


def same_device(batch: HookBatch, t: torch.Tensor) -> bool:
    """A batch holds tensors of one device (one engine call); the first tensor decides."""
    return not batch.tensors or batch.tensors[0].device == t.device


def compute_now(
    engine: Any, tensors: list[torch.Tensor]
) -> tuple[list[torch.Tensor | None], list[tuple[int, Any]]]:
    """One [1, 7] row per tensor (None: unreadable), computed now, and (index, why) of each unreadable one."""
    device = tensors[0].device
    if all(t.device == device for t in tensors):
        partials, skipped = engine.compute_rows(tensors)
        return [None if i in skipped else partials[i : i + 1] for i in range(len(tensors))], list(
            skipped.items()
        )
    rows, why = [], []  # a module spanning devices (pipeline stages in one process): one call per tensor
    for i, t in enumerate(tensors):
        partials, bad = engine.compute_rows([t])
        rows.append(None if bad else partials)
        why.extend((i, w) for w in bad.values())
    return rows, why


def learn_trust(watch: list[tuple[torch.Tensor, tuple[int, int], tuple[str, str]]], trusted: dict) -> None:
    """At a flush: a (family, label) whose watched tensors kept their stamp since their hook is trusted
    (held by reference from now on); one that changed never is."""
    for t, stamp, trust in watch:
        if stamp_of(t) != stamp:
            trusted[trust] = False
        elif trust not in trusted:
            trusted[trust] = True


def reduce_held(engine: Any, batch: HookBatch, trusted: dict, skip: Callable, faults: Any) -> None:
    """`StepCollector.flush`'s engine call: the held tensors' rows into `batch.result`; a tensor changed
    since its hook gets a NaN row (dropped by the worker), a counted fault, and its label's trust taken
    away; an unreadable one is skipped (`skip(family, why, tensor)`)."""
    result, skipped = engine.compute_rows(batch.tensors)
    for j, why in skipped.items():
        result[j, NANS] = math.nan  # dropped by the worker, as an unreadable tensor is
        family, label = batch.trust[j]
        skip(family, why, f"{label} ({batch.tensors[j].dtype})")
    for j, t in enumerate(batch.tensors):
        if stamp_of(t) != batch.stamps[j]:
            result[j, NANS] = math.nan
            trusted[batch.trust[j]] = False
            if faults is not None:
                family, label = batch.trust[j]
                faults.record(
                    "tensor changed after its hook",
                    RuntimeError(f"{family} {label} was modified in place before its batched reduction"),
                    "its row is dropped this step; it is reduced at its hook from now on",
                )
    batch.result = result
    batch.tensors, batch.stamps = [], []  # release the references
