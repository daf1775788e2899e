"""Gathers one step's partial statistics on the device and hands them to the host in one transfer.

Lifecycle per collected step: `add(...)` any number of times from hooks (each call computes partials of
its tensors on their device, no host sync), then `finish(step)` once at the step boundary: sharded rows
are merged in one packed reduction per process group, every row is concatenated, and the result goes to
the host in the step's single device-to-host copy (`transfer_to_host`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .placement import Local, Replicated, Sharded, TensorPiece, writes_rows
from .records import RowMeta, StepPayload
from .stats import NUM_PARTIALS, StatsEngine, empty_partials, reduce_across


@dataclass
class _ShardedBlock:
    group: Any
    writes: bool
    rows: list[RowMeta] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)


class TransferCounter:
    """Counts device-to-host transfers of statistics; the monitor promises one per collected step."""

    def __init__(self) -> None:
        self.count = 0


def transfer_to_host(partials: torch.Tensor, counter: TransferCounter) -> tuple[torch.Tensor, Any]:
    """The engine's single transfer point. On an accelerator the copy is non-blocking into pinned memory
    and an event is returned for the worker to wait on; the training thread does not wait."""
    counter.count += 1
    if partials.device.type == "cpu":
        return partials, None
    if partials.device.type == "npu":
        from ._device import torch_npu

        torch_npu()  # registers the NPU back-end's events and pinned memory with torch
    host = torch.empty(partials.shape, dtype=partials.dtype, pin_memory=True)
    host.copy_(partials, non_blocking=True)
    event = torch.Event(device=partials.device)
    event.record()
    return host, event


class StepCollector:
    def __init__(self, engine: StatsEngine, transfers: TransferCounter) -> None:
        self.engine = engine
        self.transfers = transfers
        self._rows: list[RowMeta] = []
        self._parts: list[torch.Tensor] = []
        self._sharded: dict[int, _ShardedBlock] = {}
        self.extras: dict[str, float | torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._rows) + sum(len(b.rows) for b in self._sharded.values())

    def add(
        self,
        family: str,
        entries: Sequence[tuple[int, str, int | None, TensorPiece]],
        also_as: str | None = None,
    ) -> None:
        """Compute and keep partials for (vpp_stage, name, micro_step, piece) entries of one family.

        Local and replicated pieces are computed only on ranks that write them; sharded pieces are
        computed on every rank (each holds a part) and merged at `finish`. `also_as` records the same
        local rows a second time under another family, without computing them again.
        """
        local_rows: list[RowMeta] = []
        local_tensors: list[torch.Tensor] = []
        pending: list[tuple[_ShardedBlock, int, torch.Tensor]] = []
        for vpp_stage, name, micro_step, piece in entries:
            meta = _meta(family, vpp_stage, name, micro_step, piece)
            placement = piece.placement
            if isinstance(placement, Sharded):
                block = self._sharded.get(id(placement.group))
                if block is None:
                    block = _ShardedBlock(placement.group, writes_rows(placement))
                    self._sharded[id(placement.group)] = block
                block.rows.append(meta)
                block.parts.append(empty_partials(1, _device_hint(entries)))
                if piece.tensor is not None and piece.tensor.numel() > 0:
                    pending.append((block, len(block.parts) - 1, piece.tensor))
                continue
            if isinstance(placement, (Local, Replicated)) and not writes_rows(placement):
                continue
            assert piece.tensor is not None
            local_rows.append(meta)
            local_tensors.append(piece.tensor)
        if pending:
            computed = self.engine.compute([t for *_, t in pending])
            for row, (block, index, _) in enumerate(pending):
                block.parts[index] = computed[row : row + 1]
        if local_tensors:
            for device_rows, device_tensors in _by_device(local_rows, local_tensors):
                partials = self.engine.compute(device_tensors)
                self._rows.extend(device_rows)
                self._parts.append(partials)
                if also_as is not None:
                    self._rows.extend(dataclasses.replace(r, family=also_as) for r in device_rows)
                    self._parts.append(partials)

    def finish(self, step: int) -> StepPayload:
        """Merge sharded rows (collectives on their groups), then move everything to the host at once.

        Collective: every rank of each sharded group must call this at the same step, with the same
        sharded rows. A rank with no rows to write gets a payload with no rows and no transfer.
        """
        rows = list(self._rows)
        parts = list(self._parts)
        for block in self._sharded.values():
            merged = reduce_across(torch.cat(block.parts), block.group)
            if block.writes:
                rows.extend(block.rows)
                parts.append(merged)
        extras = self.extras
        self.reset()
        if not rows:
            # Nothing for this rank to write (replicated rows belong to another rank): the step's
            # scalars still go out, so that live sinks see the step advance. No transfer needed.
            return StepPayload(step=step, rows=[], partials=torch.zeros((0, NUM_PARTIALS)), extras=extras)
        device = parts[0].device
        partials = torch.cat([p.to(device) for p in parts])
        host, ready = transfer_to_host(partials, self.transfers)
        return StepPayload(step=step, rows=rows, partials=host, ready=ready, extras=extras)

    def reset(self) -> None:
        self._rows = []
        self._parts = []
        self._sharded = {}
        self.extras = {}


def _meta(family: str, vpp_stage: int, name: str, micro_step: int | None, piece: TensorPiece) -> RowMeta:
    numel = 1
    for d in piece.full_shape:
        numel *= d
    return RowMeta(family, vpp_stage, name, micro_step, tuple(piece.full_shape), piece.dtype, numel)


def _device_hint(entries: Sequence[tuple[int, str, int | None, TensorPiece]]) -> torch.device:
    for *_, piece in entries:
        if piece.tensor is not None:
            return piece.tensor.device
    return torch.device("cpu")


def _by_device(rows: list[RowMeta], tensors: list[torch.Tensor]):
    devices: dict[torch.device, tuple[list[RowMeta], list[torch.Tensor]]] = {}
    for row, t in zip(rows, tensors):
        bucket = devices.setdefault(t.device, ([], []))
        bucket[0].append(row)
        bucket[1].append(t)
    return list(devices.values())
