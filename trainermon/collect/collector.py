"""Gathers one step's partial statistics on the device and hands them to the host in one transfer.

Lifecycle per collected step: `add(...)` any number of times from hooks (each call computes partials of
its tensors on their device, no host sync), then `finish(step)` once at the step boundary: sharded rows
are merged in one packed reduction per process group, every row is concatenated, and the result goes to
the host in the step's single device-to-host copy (`transfer_to_host`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainermon.failsafe import FaultLog
from trainermon.stats import NANS, NUM_PARTIALS, StatsEngine, Unreadable, empty_partials, reduce_across
from trainermon.stats.kinds import local_view

from .placement import Local, Sharded, TensorPiece, writes_rows
from .records import RowMeta, StepPayload, StepScalars
from .transfer import TransferCounter, transfer_to_host


@dataclass
class _ShardedBlock:
    group: Any
    writes: bool
    rows: list[RowMeta] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    flags: list[float] = field(default_factory=list)  # 1: a rank could not compute its piece of the row


class StepCollector:
    def __init__(
        self, engine: StatsEngine, transfers: TransferCounter, faults: FaultLog | None = None
    ) -> None:
        self.engine = engine
        self.transfers = transfers
        self.faults = faults
        self._rows: list[RowMeta] = []
        self._parts: list[torch.Tensor] = []
        self._sharded: dict[int, _ShardedBlock] = {}
        self._writes: dict[tuple[type, int], bool] = {}
        #: Tensors already computed this step, by what their values are (see `_value_key`), so that one
        #: activation seen as a module's output and as the next module's input is reduced once.
        self._seen: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}

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
        local rows a second time under another family, without computing them again. A DTensor that is
        not sharded through its placement is this rank's local piece: a row of its own, labelled with
        the piece (exact full-tensor values of DTensors need their placement in the adapter).
        """
        local_rows: list[RowMeta] = []
        local_tensors: list[torch.Tensor] = []
        pending: list[tuple[_ShardedBlock, int, torch.Tensor]] = []
        for vpp_stage, name, micro_step, piece in entries:
            placement = piece.placement
            kind = type(placement)
            tensor, shard = local_view(piece.tensor)
            shape = piece.full_shape
            if shard and kind is not Sharded:
                kind, shape = Local, tuple(tensor.shape)
            elif kind is not Local and kind is not Sharded and not self._writes_rows(placement):
                continue  # replicated: another rank of the group writes it
            meta = RowMeta(family, vpp_stage, name, micro_step, shape, piece.dtype, math.prod(shape), shard)
            if kind is Sharded:
                block = self._sharded.get(id(placement.group))
                if block is None:
                    block = _ShardedBlock(placement.group, writes_rows(placement))
                    self._sharded[id(placement.group)] = block
                block.rows.append(meta)
                block.parts.append(empty_partials(1, _device_hint(entries)))
                block.flags.append(0.0)
                if tensor is not None and tensor.numel() > 0:
                    pending.append((block, len(block.parts) - 1, tensor))
                continue
            assert tensor is not None
            local_rows.append(meta)
            local_tensors.append(tensor)
        if pending:
            computed, skipped = self.engine.compute_rows([t for *_, t in pending])
            for row, (block, index, _) in enumerate(pending):
                block.parts[index] = computed[row : row + 1]
                if row in skipped:
                    block.flags[index] = 1.0  # no rank writes a row that one rank could not compute
                    self._skip(family, skipped[row])
        if local_tensors:
            for device_rows, device_tensors in _by_device(local_rows, local_tensors):
                partials, skipped = self.engine.compute_rows(device_tensors)
                if skipped:
                    keep = [i for i in range(len(device_rows)) if i not in skipped]
                    for why in skipped.values():
                        self._skip(family, why)
                    device_rows = [device_rows[i] for i in keep]
                    partials = partials[keep]
                self._rows.extend(device_rows)
                self._parts.append(partials)
                if also_as is not None:
                    self._rows.extend(r._replace(family=also_as) for r in device_rows)
                    self._parts.append(partials)

    def add_local(
        self, family: str, vpp_stage: int, labels: Sequence[str], micro_step: int | None, tensors: Sequence
    ) -> None:
        """Rows for this rank's own tensors seen by a hook (activations and their gradients).

        A tensor whose values were already reduced this step (the same memory, unmodified: a module's
        output that is the next module's input, or a view of it) reuses that row instead of computing
        again. Cost: one engine call for the new tensors, none when all were seen.
        """
        seen = self._seen
        new_tensors: list[torch.Tensor] = []
        new_keys: list[tuple | None] = []
        slots: list[tuple[int, torch.Tensor | None]] = []  # (index into new_tensors, or -1 with a row)
        in_call: dict[tuple, int] = {}  # one tensor passed twice in this call (attn(h, h, h)): once
        shards: list[str] = []
        values: list[torch.Tensor] = []
        for t in tensors:
            t, shard = local_view(t)
            shards.append(shard)
            values.append(t)
            key = _value_key(t)
            hit = seen.get(key) if key is not None else None
            if hit is not None and _still_holds(hit, key):
                slots.append((-1, hit[1]))
                continue
            if key is not None and key in in_call:
                slots.append((in_call[key], None))
                continue
            if key is not None:
                in_call[key] = len(new_tensors)
            slots.append((len(new_tensors), None))
            new_tensors.append(t)
            new_keys.append(key)
        new_rows: list[torch.Tensor | None] = []
        if new_tensors:
            device = new_tensors[0].device
            if all(t.device == device for t in new_tensors):
                partials, skipped = self.engine.compute_rows(new_tensors)
                new_rows = [None if i in skipped else partials[i : i + 1] for i in range(len(new_tensors))]
            else:  # a module spanning devices (pipeline stages in one process): one call per tensor
                new_rows, skipped = [], {}
                for i, t in enumerate(new_tensors):
                    partials, bad = self.engine.compute_rows([t])
                    new_rows.append(None if bad else partials)
                    if bad:
                        skipped[i] = bad[0]
            for why in skipped.values():
                self._skip(family, why)
        for i, (index, reused) in enumerate(slots):
            t = values[i]
            row = reused if index < 0 else new_rows[index]
            if row is None:
                continue  # unreadable: skipped and counted above
            self._rows.append(
                RowMeta(
                    family, vpp_stage, labels[i], micro_step, tuple(t.shape), t.dtype, t.numel(), shards[i]
                )
            )
            self._parts.append(row)
            if index >= 0 and new_keys[index] is not None:
                seen[new_keys[index]] = (weakref.ref(t), row)

    def _skip(self, family: str, why: Unreadable) -> None:
        if self.faults is not None:
            self.faults.record(f"unreadable tensor ({why.kind})", why, f"its {family} row is skipped")

    def _writes_rows(self, placement: Any) -> bool:
        key = (type(placement), id(placement.group))
        writes = self._writes.get(key)
        if writes is None:
            writes = self._writes[key] = writes_rows(placement)
        return writes

    def finish(self, step: int, scalars: StepScalars) -> StepPayload:
        """Merge sharded rows (collectives on their groups), then move everything to the host at once.

        Collective: every rank of each sharded group must call this at the same step, with the same
        sharded rows. A rank with no rows to write gets a payload with no rows and no transfer.
        """
        rows = list(self._rows)
        parts = list(self._parts)
        for block in self._sharded.values():
            local = torch.cat(block.parts)
            flags = torch.tensor(block.flags, dtype=local.dtype).to(local.device, non_blocking=True)
            merged, bad = reduce_across(local, block.group, flags)
            if block.writes:
                # A row that some rank could not compute is marked (a NaN count, which no data can give)
                # and dropped by the worker: deciding here would read the flags back, a device sync.
                merged[:, NANS] = torch.where(bad, math.nan, merged[:, NANS])
                rows.extend(block.rows)
                parts.append(merged)
        self.reset()
        if not rows:
            # Nothing for this rank to write (replicated rows belong to another rank): the step's
            # scalars still go out, so that live sinks see the step advance. No transfer needed.
            empty = torch.zeros((0, NUM_PARTIALS), dtype=torch.float64)
            return StepPayload(step=step, rows=(), partials=empty, scalars=scalars)
        device = parts[0].device
        partials = torch.cat([p.to(device) for p in parts])
        host, ready = transfer_to_host(partials, self.transfers)
        return StepPayload(step=step, rows=tuple(rows), partials=host, ready=ready, scalars=scalars)

    def reset(self) -> None:
        self._rows = []
        self._parts = []
        self._sharded = {}
        self._seen = {}


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _value_key(t: torch.Tensor) -> tuple | None:
    """What identifies a tensor's values: its storage (the object and its size, not only its address),
    the place and layout of its elements in it, and its version counter (shared by views, bumped by
    in-place writes). None where that cannot be read: such tensors are always computed.

    A key found in the cache is trusted only if the tensor that was computed still has that same key
    (`_still_holds`): Megatron's pipeline schedules free an output's memory with `out.data =
    torch.empty(1)` while the tensor object lives on, and the next micro-batch's tensor of that shape gets
    the same address (and may get a storage object at the same address too). Not detected: a storage
    refilled in place without autograd seeing it (`storage.resize_(0)`, then `resize_(n)` and a raw copy)."""
    if type(t) not in _PLAIN or t.layout is not torch.strided or t.is_neg() or t.is_conj():
        return None  # only plain tensors: a view bit or a subclass changes what the same memory means
    try:
        if not t.numel():
            return None
        storage = t.untyped_storage()
        return (
            storage._cdata,
            storage.nbytes(),
            t.data_ptr(),
            t.storage_offset(),
            t.shape,
            t.stride(),
            t.dtype,
            t.device,
            t._version,
        )
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _still_holds(hit: tuple[weakref.ref, torch.Tensor], key: tuple) -> bool:
    """The tensor computed under `key` is alive and still has that key (its memory was not replaced)."""
    computed = hit[0]()
    return computed is not None and _value_key(computed) == key


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
