"""Gathers one step's partial statistics on the device and hands them to the host in one transfer.

Lifecycle per collected step: `add(...)` any number of times from hooks (each call computes partials of
its tensors on their device, no host sync), then `finish(step)` once at the step boundary: sharded rows
are merged with one packed reduction per process group (a row sharded over several groups takes part in
each of theirs), every row is concatenated, and the result goes to the host in the step's single
device-to-host copy (`transfer_to_host`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainermon.failsafe import FaultLog
from trainermon.stats import (
    NANS,
    NUM_PARTIALS,
    SUMSQ,
    StatsEngine,
    Unreadable,
    empty_partials,
    reduce_across,
)
from trainermon.stats.kinds import local_view

from .placement import Local, Placement, Sharded, TensorPiece, takes_part, writes_rows
from .records import RowMeta, StepPayload, StepScalars
from .transfer import TransferCounter, transfer_to_host


@dataclass
class _ShardedRows:
    """The step's rows that are merged across ranks at `finish`, in the order they were added (the same
    on every rank of a group, since every rank adds its piece of each sharded tensor)."""

    rows: list[RowMeta] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # each row's position among all of the step's rows
    over: list[tuple[int, ...]] = field(default_factory=list)  # ids of the groups each row merges over
    writes: list[bool] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    flags: list[float] = field(default_factory=list)  # 1: a rank could not compute its piece of the row
    groups: dict[int, Any] = field(default_factory=dict)  # id -> group, every group named by a row


class StepCollector:
    def __init__(
        self, engine: StatsEngine, transfers: TransferCounter, faults: FaultLog | None = None
    ) -> None:
        self.engine = engine
        self.transfers = transfers
        self.faults = faults
        self._rows: list[RowMeta] = []
        self._order: list[int] = []  # each row's position in the order rows were added
        self._next = 0
        self._parts: list[torch.Tensor] = []
        self._sharded = _ShardedRows()
        self._roles: dict[tuple, tuple[bool, bool]] = {}  # placement -> (takes part, writes)
        #: Tensors already computed this step, by what their values are (see `_value_key`), so that one
        #: activation seen as a module's output and as the next module's input is reduced once.
        self._seen: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._rows) + len(self._sharded.rows)

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
        local_rows: list[tuple[RowMeta, int]] = []
        local_tensors: list[torch.Tensor] = []
        pending: list[tuple[int, torch.Tensor]] = []  # (index into the sharded rows, this rank's piece)
        sharded = self._sharded
        for vpp_stage, name, micro_step, piece in entries:
            placement = piece.placement
            kind = type(placement)
            tensor, shard = local_view(piece.tensor)
            shape = piece.full_shape
            if shard and kind is not Sharded:
                kind, shape = Local, tuple(tensor.shape)
            elif kind is Local:
                shard = piece.shard
                if shard and tensor is not None:
                    shape = tuple(tensor.shape)  # a labelled piece of a larger tensor: its own shape
            takes, writes = (True, True) if kind is Local else self._roles_of(placement)
            if kind is not Sharded and not writes:
                continue  # a copy: another rank computes and writes the same values
            meta = RowMeta(family, vpp_stage, name, micro_step, shape, piece.dtype, math.prod(shape), shard)
            seq = self._next
            self._next += 1
            if kind is Sharded:
                sharded.rows.append(meta)
                sharded.order.append(seq)
                sharded.over.append(tuple(id(g) for g in placement.over))
                for g in placement.over:
                    sharded.groups.setdefault(id(g), g)
                sharded.writes.append(writes)
                sharded.parts.append(empty_partials(1, _device_hint(entries)))
                sharded.flags.append(0.0)
                # A rank off coordinate 0 of a replicated group still adds the (empty) row: every rank
                # then sees the groups in the same order, which the merge relies on (see `_merge`).
                if takes and tensor is not None and tensor.numel() > 0:
                    pending.append((len(sharded.parts) - 1, tensor))
                continue
            assert tensor is not None
            local_rows.append((meta, seq))
            local_tensors.append(tensor)
        if pending:
            computed, skipped = self.engine.compute_rows([t for _, t in pending])
            for row, (index, _) in enumerate(pending):
                sharded.parts[index] = computed[row : row + 1]
                if row in skipped:
                    sharded.flags[index] = 1.0  # no rank writes a row that one rank could not compute
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
                self._rows.extend(r for r, _ in device_rows)
                self._order.extend(seq for _, seq in device_rows)
                self._parts.append(partials)
                if also_as is not None:
                    self._rows.extend(r._replace(family=also_as) for r, _ in device_rows)
                    self._order.extend(seq for _, seq in device_rows)
                    self._parts.append(partials)

    def add_local(
        self,
        family: str,
        vpp_stage: int,
        labels: Sequence[str],
        micro_step: int | None,
        tensors: Sequence,
        shards: Sequence[str] = (),
    ) -> None:
        """Rows for this rank's own tensors seen by a hook (activations and their gradients). `shards`
        labels tensors that are pieces of a larger one (by position; a DTensor labels itself).

        A tensor whose values were already reduced this step (the same memory, unmodified: a module's
        output that is the next module's input, or a view of it) reuses that row instead of computing
        again. Cost: one engine call for the new tensors, none when all were seen.
        """
        seen = self._seen
        new_tensors: list[torch.Tensor] = []
        new_keys: list[tuple | None] = []
        slots: list[tuple[int, torch.Tensor | None]] = []  # (index into new_tensors, or -1 with a row)
        in_call: dict[tuple, int] = {}  # one tensor passed twice in this call (attn(h, h, h)): once
        labels_of: list[str] = []
        values: list[torch.Tensor] = []
        for i, t in enumerate(tensors):
            t, shard = local_view(t)
            labels_of.append(shard or (shards[i] if i < len(shards) else ""))
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
                    family, vpp_stage, labels[i], micro_step, tuple(t.shape), t.dtype, t.numel(), labels_of[i]
                )
            )
            self._parts.append(row)
            self._order.append(self._next)
            self._next += 1
            if index >= 0 and new_keys[index] is not None:
                seen[new_keys[index]] = (weakref.ref(t), row)

    def add_missing(self, family: str, vpp_stage: int, labels: Sequence[str], micro_step: int | None) -> None:
        """Rows for elements that are not tensors (a None in a module's output tuple): msprobe writes them
        as NaN statistics, and so do these (no elements, norm NaN)."""
        for label in labels:
            row = empty_partials(1)
            row[0, SUMSQ] = math.nan
            self._rows.append(RowMeta(family, vpp_stage, label, micro_step, (), None, 0))
            self._parts.append(row)
            self._order.append(self._next)
            self._next += 1

    def _skip(self, family: str, why: Unreadable) -> None:
        if self.faults is not None:
            self.faults.record(f"unreadable tensor ({why.kind})", why, f"its {family} row is skipped")

    def _roles_of(self, placement: Placement) -> tuple[bool, bool]:
        key = (type(placement), *map(id, placement.over), None, *map(id, placement.replicated))
        roles = self._roles.get(key)
        if roles is None:
            roles = self._roles[key] = (takes_part(placement), writes_rows(placement))
        return roles

    def finish(
        self, step: int, scalars: StepScalars, job_grad_norm: bool = False, tail: Any = None
    ) -> StepPayload:
        """Merge sharded rows (collectives on their groups), then move everything to the host at once.

        Collective: every rank of each sharded group must call this at the same step, with the same
        sharded rows. Cost: two all-reduces per distinct group of the step's sharded rows, in the order
        the groups first appear in the rows' placements. `job_grad_norm`: also sum the written
        `grad_reduced` rows' squares over every rank of the job (a one-element all-reduce on the default
        group, every rank at the same step), for a model split over ranks. A rank with no rows to write,
        no job norm and no tail gets a payload with no rows and no transfer. `tail(rows, parts) -> (extra
        rows or None, meta)` sees the local rows first (`xrank`); its rows ride in the same transfer.
        """
        rows = list(self._rows)
        parts = list(self._parts)
        extra, meta = tail(rows, parts) if tail is not None else (None, None)
        merged_rows, merged, merged_order = self._merge()
        permutation = None
        if merged is not None:
            if rows:  # back to the order rows were added (model order), whatever was merged
                order = self._order + merged_order
                permutation = sorted(range(len(order)), key=order.__getitem__)
            rows.extend(merged_rows)
            parts.append(merged)
        self.reset()
        if permutation is not None and permutation != list(range(len(permutation))):
            device = parts[0].device
            table = torch.cat([p.to(device) for p in parts])
            parts = [table[torch.tensor(permutation, device=device)]]
            rows = [rows[i] for i in permutation]
        tails = [_job_grad_sumsq(rows, parts)] if job_grad_norm else []
        parts += tails + ([extra] if extra is not None else [])
        if not parts:
            # Nothing for this rank to write (replicated rows belong to another rank): the step's
            # scalars still go out, so that live sinks see the step advance. No transfer needed.
            empty = torch.zeros((0, NUM_PARTIALS), dtype=torch.float64)
            return StepPayload(step=step, rows=(), partials=empty, scalars=scalars)
        device = parts[0].device
        partials = torch.cat([p.to(device) for p in parts])
        host, ready = transfer_to_host(partials, self.transfers)
        sumsq = host[len(rows), SUMSQ] if job_grad_norm else None  # rows, then the job's norm, then tail
        extra_host = None if extra is None else host[len(host) - len(extra) :]
        return StepPayload(step, tuple(rows), host[: len(rows)], ready, scalars, sumsq, extra_host, meta)

    def _merge(self) -> tuple[list[RowMeta], torch.Tensor | None, list[int]]:
        """Merge the sharded rows over each of their groups; return this rank's rows to write, their
        partials and their positions among the step's rows."""
        sharded = self._sharded
        if not sharded.rows:
            return [], None, []
        local = torch.cat(sharded.parts)
        flags = torch.tensor(sharded.flags, dtype=local.dtype).to(local.device, non_blocking=True)
        # One dimension at a time, groups in first-appearance order. Ranks that meet in a group must have
        # merged the same dimensions before, else pieces are lost or counted twice; the order is the
        # same on every rank because every rank adds the same sharded rows in the same order and
        # placements list their groups by mesh dimension. (Ordering groups by their global ranks
        # fails: on a 2 x 2 mesh rank 2 would merge dp first while rank 3 merges tp first.)
        for gid in sharded.groups:
            members = [i for i, over in enumerate(sharded.over) if gid in over]
            if len(members) == len(sharded.rows):
                local, bad = reduce_across(local, sharded.groups[gid], flags)
                flags = bad.to(local.dtype)
            else:
                index = torch.tensor(members, device=local.device)
                part, bad = reduce_across(local[index], sharded.groups[gid], flags[index])
                local[index] = part
                flags[index] = bad.to(local.dtype)
        if all(sharded.writes):
            out, rows, order = local, sharded.rows, sharded.order
        elif not any(sharded.writes):
            return [], None, []
        else:
            keep = [i for i, w in enumerate(sharded.writes) if w]
            index = torch.tensor(keep, device=local.device)
            out, flags, rows = local[index], flags[index], [sharded.rows[i] for i in keep]
            order = [sharded.order[i] for i in keep]
        # A row that some rank could not compute is marked (a NaN count, which no data can give) and
        # dropped by the worker: deciding here would read the flags back, a device sync.
        out[:, NANS] = torch.where(flags > 0, math.nan, out[:, NANS])
        return rows, out, order

    def reset(self) -> None:
        self._rows = []
        self._order = []
        self._next = 0
        self._parts = []
        self._sharded = _ShardedRows()
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


def _job_grad_sumsq(rows: list[RowMeta], parts: list[torch.Tensor]) -> torch.Tensor:
    """One partials row whose SUMSQ is the sum of norm^2 over every rank's written grad_reduced rows."""
    device = parts[0].device if parts else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    if rows:
        table = torch.cat([p.to(device) for p in parts])
        mine = [i for i, r in enumerate(rows) if r.family == "grad_reduced"]
        if mine:
            total = table[torch.tensor(mine, device=device), SUMSQ].sum()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    out = empty_partials(1, device)
    out[0, SUMSQ] = total
    return out


def _device_hint(entries: Sequence[tuple[int, str, int | None, TensorPiece]]) -> torch.device:
    for *_, piece in entries:
        if piece.tensor is not None:
            return piece.tensor.device
    return torch.device("cpu")


def _by_device(rows: list, tensors: list[torch.Tensor]):
    devices: dict[torch.device, tuple[list, list[torch.Tensor]]] = {}
    for row, t in zip(rows, tensors):
        bucket = devices.setdefault(t.device, ([], []))
        bucket[0].append(row)
        bucket[1].append(t)
    return list(devices.values())
