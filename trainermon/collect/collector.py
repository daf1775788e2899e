"""Gathers one step's partial statistics on the device and hands them to the host in one transfer.

Lifecycle per collected step: `add(...)` any number of times from hooks (each call computes partials of
its tensors on their device, no host sync), then `finish(step)` once at the step boundary: sharded rows
are merged with one packed reduction per process group (a row sharded over several groups takes part in
each of theirs), every row is concatenated, and the result goes to the host in the step's single
device-to-host copy (`transfer_to_host`). Tensors seen by hooks come in through `add_local`, whose rows
and within-step state live in `hook_rows.HookRows`; the parameter families through `add` and `add_whole`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from trainermon.failsafe import FaultLog
from trainermon.stats import NUM_PARTIALS, SUMSQ, StatsEngine, Unreadable, empty_partials
from trainermon.stats.engine import check_not_capturing
from trainermon.stats.kinds import local_view

from .batch import Span, TableRun
from .hook_rows import HookRows
from .odd import GRAD_FAMILIES, complex_rows
from .placement import Local, Placement, Sharded, TensorPiece, takes_part, writes_rows
from .records import RowMeta, RowMetaCache, StepPayload, StepScalars
from .sharded import ShardedRows, by_device, device_hint, job_sumsq_row, local_grad_sumsq, merge_sharded
from .transfer import TransferCounter, on_device, to_device, transfer_to_host


class StepCollector(HookRows):
    def __init__(
        self, engine: StatsEngine, transfers: TransferCounter, faults: FaultLog | None = None
    ) -> None:
        self.engine = engine
        self.transfers = transfers
        self.faults = faults
        self._rows: list[RowMeta] = []
        self._metas = RowMetaCache()  # kept across steps: see RowMetaCache
        self._order: list[int] = []  # each row's position in the order rows were added
        self._next = 0
        self._parts: list[torch.Tensor] = []
        self._sharded = ShardedRows()
        self._roles: dict[tuple, tuple[bool, bool]] = {}  # placement -> (takes part, writes)
        self._told: set[str] = set()  # complex gradients told of (`complex_rows`)
        self._init_hook_rows()

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
        the piece (exact full-tensor values of DTensors need their placement in the adapter). Refused
        (`CapturingCudaGraph`) while a CUDA graph is captured, before anything is recorded.
        """
        check_not_capturing()
        local_rows: list[tuple[RowMeta, int]] = []
        local_tensors: list[torch.Tensor] = []
        pending: list[tuple[int, torch.Tensor]] = []  # (index into the sharded rows, this rank's piece)
        sharded = self._sharded
        metas = self._metas
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
            meta = metas.get(
                (family, vpp_stage, name, micro_step, shape, piece.dtype, math.prod(shape), shard, 0, 0)
            )
            seq = self._next
            self._next += 1
            if kind is Sharded:
                # A rank off coordinate 0 of a replicated group still adds the (empty) row: every rank
                # then sees the groups in the same order, which the merge relies on (see `merge_sharded`).
                device = device_hint(entries, placement.over[0])
                index = sharded.append(meta, seq, placement.over, writes, device)
                if takes and tensor is not None and tensor.numel() > 0:
                    pending.append((index, tensor))
                continue
            assert tensor is not None
            local_rows.append((meta, seq))
            local_tensors.append(tensor)
        if pending:
            told = self._told if family in GRAD_FAMILIES else None  # complex pieces: rows of |z|
            for meta, why in sharded.compute(self.engine, pending, told):
                self._skip(family, why, f"{meta.name} ({meta.dtype})")
        if local_tensors:
            self._add_local_rows(family, local_rows, local_tensors, also_as)

    def add_whole(
        self,
        family: str,
        stages: Sequence[int],
        names: Sequence[str],
        tensors: Sequence[torch.Tensor | None],
        placement: Placement,
        also_as: str | None = None,
    ) -> None:
        """`add` for whole plain tensors under one placement that is not sharded (an adapter's
        `read_whole`), at (stages[i], names[i]), micro-step None; None in `tensors`: no row. The same rows
        in the same order as `add` of their `TensorPiece.whole` entries, without a piece and an entry built
        and taken apart per tensor (~1 us less a tensor on the update side)."""
        check_not_capturing()
        if type(placement) is Sharded:
            raise ValueError("add_whole: a sharded placement's rows are merged at finish: use add")
        if type(placement) is not Local and not self._roles_of(placement)[1]:
            return  # copies: another rank computes and writes the same values
        metas = self._metas
        rows: list[tuple[RowMeta, int]] = []
        kept: list[torch.Tensor] = []
        seq = self._next
        for stage, name, t in zip(stages, names, tensors):
            if t is not None:
                meta = metas.get((family, stage, name, None, tuple(t.shape), t.dtype, t.numel(), "", 0, 0))
                rows.append((meta, seq))
                kept.append(t)
                seq += 1
        self._next = seq
        if kept:
            self._add_local_rows(family, rows, kept, also_as)

    def _add_local_rows(
        self,
        family: str,
        local_rows: list[tuple[RowMeta, int]],
        local_tensors: list[torch.Tensor],
        also_as: str | None,
    ) -> None:
        """Compute this rank's rows (one engine call per device) and keep them, twice with `also_as`."""
        for device_rows, device_tensors in by_device(local_rows, local_tensors):
            partials, skipped = self.engine.compute_rows(device_tensors)
            if skipped:  # rare: only steps with a tensor the engine refuses pay for this
                reduced = "grad_reduced" in (family, also_as)  # without DDP, a copy of grad_unreduced
                if family in GRAD_FAMILIES:
                    complex_rows(self.engine, partials, skipped, device_rows, device_tensors, self._told)
                for i, why in skipped.items():
                    meta = device_rows[i][0]
                    self._skip(family, why, f"{meta.name} ({meta.dtype})")
                    if reduced:  # kept as a dropped row: the global norm becomes NaN
                        partials[i] = math.nan
                keep = [i for i in range(len(device_rows)) if i not in skipped or reduced]
                device_rows = [device_rows[i] for i in keep]
                partials = partials[keep]
            self._rows.extend(r for r, _ in device_rows)
            self._order.extend(seq for _, seq in device_rows)
            self._parts.append(partials)
            if also_as is not None:
                self._rows.extend(self._metas.get((also_as, *r[1:])) for r, _ in device_rows)
                self._order.extend(seq for _, seq in device_rows)
                self._parts.append(partials)

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

    def add_computed(self, metas: Sequence[RowMeta], parts: Sequence[torch.Tensor]) -> None:
        """Rows whose partials were computed already, one [1, NUM_PARTIALS] row each (the comm probe's
        sums of a step's collectives): kept as they are, in order."""
        for meta, row in zip(metas, parts):
            self._rows.append(meta)
            self._parts.append(row)
            self._order.append(self._next)
            self._next += 1

    def mark(self) -> tuple[int, ...]:
        """Where the step's parameter-family rows end now (`take_out`): the kept rows, their partials'
        parts and the sharded rows. Hook rows (`add_local`) are kept elsewhere and not counted."""
        return len(self._rows), len(self._parts), len(self._sharded.rows)

    def restart(self, marks: tuple[tuple[int, ...], tuple[int, ...]] | None) -> tuple[int, ...]:
        """`take_out(*marks)` when given (an earlier read of the rows being read again), then `mark()`."""
        if marks is not None:
            self.take_out(*marks)
        return self.mark()

    def take_out(self, start: tuple[int, ...], end: tuple[int, ...]) -> None:
        """Remove the rows added between two marks of this step (the same step, `end` after `start`):
        rows added after `end` stay. Nothing is computed or moved; the rows' partials are dropped."""
        (rows0, parts0, sharded0), (rows1, parts1, sharded1) = start, end
        del self._rows[rows0:rows1], self._order[rows0:rows1], self._parts[parts0:parts1]
        kept = self._sharded
        for column in (kept.rows, kept.order, kept.over, kept.writes, kept.parts, kept.flags):
            del column[sharded0:sharded1]

    def _skip(self, family: str, why: Unreadable, tensor: str) -> None:
        """A tensor the engine refuses by design: counted, and told once per `tensor` (name and dtype)."""
        if self.faults is not None:
            self.faults.refused(f"unreadable tensor ({why.kind})", tensor, why)

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
        sharded rows. Cost: one all-gather of the packed rows per distinct group of the step's sharded
        rows, in the order the groups first appear in the rows' placements. `job_grad_norm`: also sum
        the written `grad_reduced` rows' squares over every rank of the job (every rank at the same
        step), for a model split over ranks: carried by the tail's collective on the default group
        when there is one, else a one-element all-reduce there. A rank with no rows to write, no job
        norm and no tail gets a payload with no rows and no transfer. `tail(rows, parts, add) -> (extra
        rows or None, meta, add summed over the job or None)` sees the local rows first (`xrank`); its
        rows ride in the same transfer.
        """
        self.flush()
        rows = list(self._rows)
        parts = [p.values() if type(p) in _DEFERRED else p for p in self._parts]
        local = local_grad_sumsq(rows, parts, self._sharded) if job_grad_norm else None
        extra, meta, summed = tail(rows, parts, local) if tail is not None else (None, None, None)
        merged_rows, merged, merged_order = merge_sharded(self._sharded)
        permutation = None
        if merged is not None:
            if rows:  # back to the order rows were added (model order), whatever was merged
                order = self._order + merged_order
                permutation = sorted(range(len(order)), key=order.__getitem__)
            rows.extend(merged_rows)
            parts.append(merged)
        self._metas.end_step(len(rows))
        self.reset()
        if permutation is not None and permutation != list(range(len(permutation))):
            device = parts[0].device
            table = torch.cat([on_device(p, device) for p in parts])
            parts = [table[to_device(permutation, device)]]
            rows = [rows[i] for i in permutation]
        tails = [job_sumsq_row(local, summed)] if local is not None else []
        parts += tails + ([extra] if extra is not None else [])
        if not parts:
            # Nothing for this rank to write (replicated rows belong to another rank): the step's
            # scalars still go out, so that live sinks see the step advance. No transfer needed.
            empty = torch.zeros((0, NUM_PARTIALS), dtype=torch.float64)
            return StepPayload(step=step, rows=(), partials=empty, scalars=scalars)
        device = parts[0].device
        partials = torch.cat([on_device(p, device) for p in parts])
        host, ready = transfer_to_host(partials, self.transfers)
        sumsq = host[len(rows), SUMSQ] if job_grad_norm else None  # rows, then the job's norm, then tail
        extra_host = None if extra is None else host[len(host) - len(extra) :]
        return StepPayload(step, tuple(rows), host[: len(rows)], ready, scalars, sumsq, extra_host, meta)

    def reset(self) -> None:
        self._rows = []
        self._order = []
        self._next = 0
        self._parts = []
        self._sharded = ShardedRows()
        self._reset_hook_rows()


_DEFERRED = (Span, TableRun)  # parts whose values are read at `finish`
