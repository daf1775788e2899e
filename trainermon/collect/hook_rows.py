"""The rows of tensors seen by hooks (activations and their gradients): `StepCollector`'s hook side.

A hook's tensor is read at the hook into the step's row table where the native kernel can read it, held by
reference and reduced with others at a `flush` where its label proved stable, or reduced at once. A tensor
seen again this step (the same object, or the same memory unmodified) reuses its row. The rows join the
collector's step rows in the order they were added (`_rows`, `_parts`, `_order`, `_next`, kept by
`StepCollector`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from trainermon.stats.engine import check_not_capturing
from trainermon.stats.kinds import PLAIN_TYPES as _PLAIN
from trainermon.stats.kinds import local_view

from .batch import (
    ACCELERATOR_HOLD_BYTES,
    HOLD_BYTES,
    HOLD_COUNT,
    HookBatch,
    RowTable,
    Span,
    TableRun,
    compute_now,
    hold_limit,
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


class HookRows:
    """`add_local` and `flush`, with the state they keep within a step. A base of `StepCollector`, whose
    `__init__` calls `_init_hook_rows` and whose `reset` calls `_reset_hook_rows`; it also provides the
    engine, the row lists, the row cache (`_metas`) and `_skip`."""

    def _init_hook_rows(self) -> None:
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
        #: Bytes of hook tensors held for one batched reduction, on the CPU and on an accelerator (the
        #: config's `accelerator_hold_mib`; 0: reduced before the hook returns).
        self.hold_bytes = HOLD_BYTES
        self.hold_bytes_accelerator = ACCELERATOR_HOLD_BYTES
        #: Tensors already computed this step, by what their values are (`identity.value_key`), so that
        #: one activation seen as a module's output and as the next module's input is reduced once: the
        #: tensor computed (weakly) and its row. Separate dicts: a tuple holding a weak reference is never
        #: untracked by the garbage collector (see `records.RowMetaCache` for why that matters).
        self._seen: dict[tuple, weakref.ref] = {}
        self._seen_row: dict[tuple, Any] = {}
        #: The same by object: id -> (value key, stamp) (checked by weak reference, version and address)
        self._by_id: dict[int, tuple[tuple, tuple[int, int]]] = {}

    def _reset_hook_rows(self) -> None:
        self._seen, self._seen_row, self._by_id = {}, {}, {}
        self._table = RowTable(self._table.capacity)  # this step's size: no growth next step
        self._batch = HookBatch()
        self._watch = []
        self._held = 0

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
        seeing it (a compiled graph's buffers, reused by the compiler): never matched against other
        tensors nor matched by them, never held by reference. Those the native kernel does not read at
        once are copied into the batch (the copies count against the hold: `accelerator_hold_mib` on a
        GPU, 2 MiB on the CPU; a tensor larger than the hold is reduced before the call returns, uncopied).

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
        now_labels: list[str] = []  # each `now` tensor's label: a refusal names it
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
            elif (
                transient
                and self.batching
                and self._fits_hold(t)
                and same_device(batch, t)
                and not torch.is_inference_mode_enabled()  # a copy made there has no version counter
            ):
                # The compiler may write over a graph's buffer once the tap returns: a copy of it waits
                # for the batch instead of an engine call per tap (~100-150 us of host time each on a GPU)
                size = t.numel() * t.element_size()
                if self._held + size > self._hold_of(t):
                    self.flush()  # copies are new memory: reduce what is held before going past the hold
                    batch = self._batch
                copy = t.detach().clone()
                stamp = stamp_of(copy)  # before any append: a batch's lists stay aligned if it raises
                ref = (batch, len(batch.tensors))
                batch.tensors.append(copy)
                batch.stamps.append(stamp)
                batch.trust.append(trust)
                self._held += size
            elif transient:
                ref = -1 - len(now)
                now.append(t)
                now_labels.append(labels[i])
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
                now_labels.append(labels[i])
                if key is not None and self.batching and trust not in trusted:
                    alias = t.detach()  # learning: checked at the next flush, as a batched tensor would be
                    self._watch.append((alias, stamp_of(alias), trust))
                    self._held += t.numel() * t.element_size()
            refs.append(ref)
            if key is not None:
                in_call[key] = ref
        if now:
            rows, skipped = compute_now(self.engine, now)
            for j, why in skipped:
                self._skip(family, why, f"{now_labels[j]} ({now[j].dtype})")
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
        limit = hold_limit(batch, self.hold_bytes, self.hold_bytes_accelerator)
        if self._held > limit or len(batch.tensors) + len(self._watch) > HOLD_COUNT:
            self.flush()

    def _hold_of(self, t: torch.Tensor) -> int:
        """Bytes of hook tensors the batch may hold on `t`'s device."""
        return self.hold_bytes if t.device.type == "cpu" else self.hold_bytes_accelerator

    def _fits_hold(self, t: torch.Tensor) -> bool:
        """Whether a copy of `t` alone fits the hold of its device (a larger one is reduced at once)."""
        return 0 < t.numel() * t.element_size() <= self._hold_of(t)

    def flush(self) -> None:
        """Reduce the tensors recorded by reference in one engine call, and check that every tensor held
        since the last flush still has the values it had at its hook (version counter and address).

        Held tensors: at most `hold_bytes` on the CPU, `hold_bytes_accelerator` on an accelerator (plus one
        tensor), are kept alive beyond their hook, the memory this costs. A (family, label) is batched
        only after a step in which its tensors were reduced at their hook and found unchanged at the flush
        that followed (an in-place op after the hook, such as `ReLU(inplace=True)` on a module's output,
        or Megatron freeing an output with `.data = `);
        should a batched tensor still change (a data-dependent path), its row is dropped and counted as
        a fault, and the label is reduced at its hook from then on. Not detected, as for the shared-row
        cache: memory rewritten without the version counter seeing it."""
        batch, watch = self._batch, self._watch
        self._batch, self._watch, self._held = HookBatch(), [], 0
        learn_trust(watch, self._trusted)
        if batch.tensors:
            reduce_held(self.engine, batch, self._trusted, self._skip, self.faults)


def _still_holds(computed_ref: weakref.ref, key: tuple) -> bool:
    """The tensor computed under `key` is alive and still has that key (its memory was not replaced)."""
    computed = computed_ref()
    return computed is not None and _value_key(computed) == key
