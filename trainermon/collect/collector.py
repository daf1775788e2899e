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
from typing import Any

import torch

from trainermon.failsafe import FaultLog
from trainermon.stats import NUM_PARTIALS, SUMSQ, StatsEngine, Unreadable, empty_partials
from trainermon.stats.engine import check_not_capturing
from trainermon.stats.kinds import PLAIN_TYPES as _PLAIN
from trainermon.stats.kinds import local_view

from .batch import (
    HOLD_BYTES,
    HOLD_COUNT,
    HookBatch,
    RowTable,
    Span,
    TableRun,
    compute_now,
    learn_trust,
    reduce_held,
    same_device,
    stamp_of,
)
from .identity import KEY_ADDRESS as _KEY_ADDRESS
from .identity import KEY_DTYPE as _KEY_DTYPE
from .identity import KEY_SHAPE as _KEY_SHAPE
from .identity import KEY_VERSION as _KEY_VERSION
from .identity import value_key as _value_key  # a name tests replace to turn the sharing off
from .placement import Local, Placement, Sharded, TensorPiece, takes_part, writes_rows
from .records import RowMeta, RowMetaCache, StepPayload, StepScalars
from .sharded import ShardedRows, by_device, device_hint, job_sumsq_row, local_grad_sumsq, merge_sharded
from .transfer import TransferCounter, on_device, to_device, transfer_to_host


class StepCollector:
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
        self._table = RowTable()
        self._batch = HookBatch()
        self._watch: list[tuple[torch.Tensor, tuple[int, int], tuple[str, str]]] = []  # reduced, checked
        self._held = 0  # bytes of the tensors held in `_batch` and `_watch`
        #: (family, label) -> whether its tensors stay unchanged from their hook to the next flush
        #: (learned on the first step that sees the label; kept for the run)
        self._trusted: dict[tuple[str, str], bool] = {}
        #: Record trusted hook tensors by reference and reduce them in batches (tests turn it off).
        self.batching = True
        #: Reduce hook tensors the native kernel reads at their hook (benchmarks turn it off to compare).
        self.at_hook = True
        #: Bytes of hook tensors held for one batched reduction (benchmarks raise it on GPUs to compare).
        self.hold_bytes = HOLD_BYTES
        self._roles: dict[tuple, tuple[bool, bool]] = {}  # placement -> (takes part, writes)
        #: Tensors already computed this step, by what their values are (`identity.value_key`), so that
        #: one activation seen as a module's output and as the next module's input is reduced once: the
        #: tensor computed (weakly) and its row. Separate dicts: a tuple holding a weak reference is never
        #: untracked by the garbage collector (see `records.RowMetaCache` for why that matters).
        self._seen: dict[tuple, weakref.ref] = {}
        self._seen_row: dict[tuple, Any] = {}
        #: The same by object: id -> (value key, stamp) (checked by weak reference, version and address)
        self._by_id: dict[int, tuple[tuple, tuple[int, int]]] = {}

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
                index = sharded.append(meta, seq, placement.over, writes, device_hint(entries))
                if takes and tensor is not None and tensor.numel() > 0:
                    pending.append((index, tensor))
                continue
            assert tensor is not None
            local_rows.append((meta, seq))
            local_tensors.append(tensor)
        if pending:
            for why in sharded.compute(self.engine, pending):
                self._skip(family, why)
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
                self._rows.extend(self._metas.get((also_as, *r[1:])) for r, _ in device_rows)
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
        transient: bool = False,
    ) -> None:
        """Rows for this rank's own tensors seen by a hook (activations and their gradients). `shards`
        labels tensors that are pieces of a larger one (by position; a DTensor labels itself).
        `transient`: their memory may be rewritten once the call returns without their version counter
        seeing it (a compiled graph's buffers, reused by the compiler): reduced now, never matched
        against other tensors nor matched by them, never held.

        A tensor already reduced this step (the same memory, unmodified: a module's output that is the
        next module's input, or a view of it) reuses that row. One the native kernel reads is reduced now,
        while in cache, into the step's row table (`StatsEngine.kernel_row`). Elsewhere, tensors of a
        (family, label) known to stay unchanged until the next `flush` are held by reference and reduced
        together (see `flush`); the others cost one engine call for this call's new tensors. Refused
        (`CapturingCudaGraph`) while a CUDA graph is captured: a held buffer would be read after replays."""
        check_not_capturing()
        seen, seen_row, by_id = self._seen, self._seen_row, self._by_id
        trusted = self._trusted
        batch = self._batch
        table = self._table
        engine = self.engine
        direct = self.at_hook and engine.writes_rows_directly()
        now: list[torch.Tensor] = []
        # per tensor: a row of the table (int >= 0), -1 - its index into `now`, a [1, 7] row, (batch,
        # index), or None (unreadable)
        refs: list[Any] = []
        fresh: list[tuple | None] = []  # per tensor: its value key when this call reduces it
        in_call: dict[tuple, Any] = {}  # one tensor passed twice in this call (attn(h, h, h)): once
        labels_of: list[str] = []
        values: list[torch.Tensor] = []
        for i, t in enumerate(tensors):
            shard = ""
            wrapped = False
            if type(t) not in _PLAIN:  # a DTensor: its local values, labelled (plain tensors: no call)
                local, shard = local_view(t)
                # A DTensor's in-place write bumps its own version counter, not its local tensor's: the
                # local tensor is reduced now, never matched nor held (a later write would go unseen).
                wrapped = local is not t
                t = local
            labels_of.append(shard or (shards[i] if i < len(shards) else ""))
            values.append(t)
            known = None if transient or wrapped else by_id.get(id(t))
            if known is not None and seen[known[0]]() is t and known[1] == (t._version, t.data_ptr()):
                refs.append(seen_row[known[0]])  # the same object, unchanged: its row (no value key to build)
                fresh.append(None)
                continue
            key = None if wrapped else _value_key(t)
            if key is not None and not transient:
                hit = seen.get(key)
                if hit is not None and _still_holds(hit, key):
                    refs.append(seen_row[key])
                    fresh.append(None)
                    continue
            if key is not None and key in in_call:
                refs.append(in_call[key])
                fresh.append(None)
                continue
            trust = (family, labels[i])
            fresh.append(key)
            row = table.write(engine, t) if direct else None
            if row is not None:
                ref = row  # read now, while the hook's tensor is in cache
            elif transient:
                ref = -1 - len(now)
                now.append(t)
            elif key is not None and self.batching and trusted.get(trust) and same_device(batch, t):
                ref = (batch, len(batch.tensors))
                # An alias: the values stay reachable (and exact) if the tensor's own memory is swapped
                # (`.data = ...`), while in-place writes still show in the version counter they share.
                alias = t.detach()
                batch.tensors.append(alias)
                batch.stamps.append(stamp_of(alias))
                batch.trust.append(trust)
                self._held += t.numel() * t.element_size()
            else:
                ref = -1 - len(now)
                now.append(t)
                if key is not None and self.batching and trust not in trusted:
                    alias = t.detach()  # learning: checked at the next flush, as a batched tensor would be
                    self._watch.append((alias, stamp_of(alias), trust))
                    self._held += t.numel() * t.element_size()
            refs.append(ref)
            if key is not None:
                in_call[key] = ref
        if now:
            rows, skipped = compute_now(self.engine, now)
            for why in skipped:
                self._skip(family, why)
            refs = [rows[-1 - r] if type(r) is int and r < 0 else r for r in refs]
        parts, metas, out_rows, order = self._parts, self._metas, self._rows, self._order
        seq = self._next
        for i, ref in enumerate(refs):
            if ref is None:
                continue  # unreadable: skipped and counted above
            t = values[i]
            key = fresh[i]
            if key is not None:  # the key holds the shape, dtype, address and version: no second read
                shape, dtype = key[_KEY_SHAPE], key[_KEY_DTYPE]
            else:
                shape, dtype = tuple(t.shape), t.dtype
            if key is not None and not transient:
                seen[key] = weakref.ref(t)
                seen_row[key] = ref
                by_id[id(t)] = (key, (key[_KEY_VERSION], key[_KEY_ADDRESS]))
            out_rows.append(
                metas.get(
                    (family, vpp_stage, labels[i], micro_step, shape, dtype, t.numel(), labels_of[i], 0, 0)
                )
            )
            order.append(seq)
            seq += 1
            last = parts[-1] if parts else None
            if type(ref) is int:  # a row of the table: extend the run of table rows before it
                if type(last) is TableRun:
                    last.rows.append(ref)
                else:
                    parts.append(TableRun(table, [ref]))
            elif type(ref) is tuple:  # a batched row: extend the previous span of the same batch if adjacent
                if type(last) is Span and last.batch is ref[0] and last.stop == ref[1]:
                    last.stop += 1
                else:
                    parts.append(Span(ref[0], ref[1], ref[1] + 1))
            else:
                parts.append(ref)
        self._next = seq
        if self._held > self.hold_bytes or len(batch.tensors) + len(self._watch) > HOLD_COUNT:
            self.flush()

    def flush(self) -> None:
        """Reduce the tensors recorded by reference in one engine call, and check that every tensor held
        since the last flush still has the values it had at its hook (version counter and address).

        Held tensors: at most `hold_bytes` (plus one tensor) are kept alive beyond their hook, the memory
        this costs. A (family, label) is batched only after a step in which its tensors were reduced at
        their hook and found unchanged at the flush that followed (an in-place op after the hook, such
        as `ReLU(inplace=True)` on a module's output, or Megatron freeing an output with `.data = `);
        should a batched tensor still change (a data-dependent path), its row is dropped and counted as
        a fault, and the label is reduced at its hook from then on. Not detected, as for the shared-row
        cache: memory rewritten without the version counter seeing it."""
        batch, watch = self._batch, self._watch
        self._batch, self._watch, self._held = HookBatch(), [], 0
        learn_trust(watch, self._trusted)
        if batch.tensors:
            reduce_held(self.engine, batch, self._trusted, self._skip, self.faults)

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
        self._seen, self._seen_row, self._by_id = {}, {}, {}
        self._table = RowTable(len(self._table.result))  # this step's size: no growth next step
        self._batch = HookBatch()
        self._watch = []
        self._held = 0


_DEFERRED = (Span, TableRun)  # parts whose values are read at `finish`


def _still_holds(computed_ref: weakref.ref, key: tuple) -> bool:
    """The tensor computed under `key` is alive and still has that key (its memory was not replaced)."""
    computed = computed_ref()
    return computed is not None and _value_key(computed) == key
