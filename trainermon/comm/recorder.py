"""What the wrappers do on a collected step: resolve the call site and the group, filter by
`cc_codeline` and `ops`, compute the statistics of the inputs (before the call) and of the outputs (when
the call completes: at once for a blocking call, from the returned work's future for `async_op=True`,
after the wait for a functional collective), and sum them per (op, group, call site, input/output,
micro-step). `rows()` turns a step's sums into `comm` rows; `checks()` gives what the invariant checks
need. Completion callbacks may run on the backend's thread: every change of the sums takes `lock`.

Torch's order (`ivalue::Future::markCompleted`): a future sets its value, wakes its `wait()`ers, then runs
its callbacks in the order added, on the completing thread; one added to a done future runs at once on the
adding thread. NCCL's future is done at enqueue (CUDA events): our callback runs at once, on a stream that
waits for the collective, ahead of anything the caller enqueues later. Gloo's completes on its worker
thread, `Work.wait()` / `is_completed()` return after the callbacks, but a waiter on the future
(PowerSGD's `get_future().wait()`) resumes before them and may change the output in place first; and a
callback chained after ours on a future that completes in between runs at once on the chaining thread,
possibly before ours has run on the backend's (PowerSGD's body chains a `div_` of its all-reduce's output).
So an async collective issued by one of DDP's communication hooks (its body or a callback it chains)
whose future is not done at return is waited for at the call (collected steps) and
read there, as the collective produced it. Any other async call keeps its completion callback: a wait at
the call would make it blocking, and a program that issues async calls on two groups in different orders
on different ranks (legal on gloo: a worker per group) would deadlock. A callback that
still runs on the backend's thread (a batch's receives) may wait for the GIL after DDP's own `.then` let
the backward finish: the step's end (`settle`) waits for every completed call's callback."""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainermon.collect.records import RowMeta
from trainermon.config.schema import CommConfig
from trainermon.runtime.side_passes import SIDE_PASSES
from trainermon.stats.partials import ADDITIVE, MAX, MIN, empty_partials

from .checks import CheckEntry, CheckKey
from .groups import describe
from .pipe_passes import PIPE
from .sites import call_site, short, within_comm_hook
from .spec import OpSpec, redop_name
from .sums import PendingMicro, Sum, merge_into, settle_micro

FAMILY = "comm"
#: How long the step's end waits, in all, for the completion callbacks of collectives that have completed
#: (they run on the backend's thread and need the GIL); only a stuck callback makes it wait that long.
CALLBACK_WAIT_S = 10.0


@dataclass
class _Call:
    spec: OpSpec
    group: str
    ranks: tuple[int, ...]
    site: str
    micro: int | PendingMicro
    outputs: list[torch.Tensor]
    check: CheckKey | None
    generation: int


#: `_stats` of a payload the engine cannot read (complex, ...): said and counted there; no row, no check.
UNREADABLE = object()


class CommRecorder:
    def __init__(
        self,
        compute: Callable[[list[torch.Tensor]], tuple[torch.Tensor, dict]],
        fault: Callable[..., None],  # (where, exc[, consequence]): the monitor's FaultLog.record
        rank: int,
        lock: Any,
    ) -> None:
        self.compute = compute  # the loop's engine under the loop's lock
        self._fault = fault
        self.rank = rank
        self.lock = lock
        self.config = CommConfig()
        self.on = False
        self.busy: Callable[[], bool] = lambda: False  # the monitor's own collectives are not watched
        self.micro: Callable[[], int] = lambda: 0
        self.recv_micro: Callable[[], int | PendingMicro] = lambda: self.micro()  # a receive's micro-step
        self.generation = 0
        self._patterns: list[re.Pattern] = []
        self._matches: dict[str, bool] = {}
        self.unmatched: set[str] = set()  # sites seen that no cc_codeline pattern matched
        self.sites: Counter[tuple[str, str, str]] = Counter()  # cc_log_only: (op, group, site) -> calls
        self.pending: list[tuple[Any, Callable[[], None]]] = []  # works without a future
        #: Completion callbacks not yet run: {key: (future, set when it has run)}; each removes its entry
        self.inflight: dict[int, tuple[Any, threading.Event]] = {}
        self._keys = itertools.count()
        self.coalesced: list[_Call] = []  # queued in a _coalescing_manager block: read at its exit
        self.reset()

    def configure(self, config: CommConfig) -> None:
        self.config = config
        self._patterns = [re.compile(p) for p in config.cc_codeline]
        self._matches = {}

    def reset(self) -> None:
        with self.lock:
            self.sums: dict[tuple, Sum] = {}
            self.check_entries: dict[CheckKey, CheckEntry] = {}
            self.generation += 1
        self.inflight.clear()  # a step left unsettled (a switch-off): its callbacks are dropped by generation

    # ==== the wrappers' side ====================================================================
    def active(self) -> bool:
        # a framework's own pass (pipelining's shape inference) moves no training data
        return self.on and not SIDE_PASSES.depth and not self.busy()

    def fault(self, where: str, exc: BaseException) -> None:
        self._fault(where, exc)

    def _matched(self, site: str) -> bool:
        if not self._patterns:
            return True
        hit = self._matches.get(site)
        if hit is None:
            hit = self._matches[site] = any(p.search(site) for p in self._patterns)
            if not hit:
                self.unmatched.add(site)
        return hit

    def before(self, spec: OpSpec, args: tuple, kwargs: dict) -> _Call | None:
        site = call_site()
        if not self._matched(site):
            return None
        group, ranks = describe(spec.group(args, kwargs))
        if self.config.cc_log_only:
            self.sites[(spec.name, group, site)] += 1
            return None
        micro = _tagged(args, kwargs) if spec.name in _P2P and PIPE.tensors else None
        if micro is None:
            micro = self.recv_micro() if spec.name in _RECV else self.micro()
        if spec.count_only:
            self._add((spec.name, group, site, "calls", micro), None)
            return None
        src = spec.src(args, kwargs)
        inputs = spec.inputs(args, kwargs)
        if spec.check == "broadcast" and src != self.rank:
            inputs = []  # only the source's tensor is an input
        check = None
        if self.config.check and spec.check is not None:
            redop = redop_name(spec.redop(args, kwargs))
            check = CheckKey(spec.check, spec.name, redop, group, ranks, site, src)
        sent = spec.name in _SEND
        if inputs and (self.config.cc_pre_hook or sent or check is not None):
            stats = self._stats(inputs, spec.name, group, site)
            if stats is UNREADABLE:
                return None  # its outputs are not read either: one fault per call
            if stats is None and sent:  # nothing to measure (an empty tensor): the call is still counted
                self._add((spec.name, group, site, "calls", micro), None)
            if stats is not None:
                if self.config.cc_pre_hook or sent:
                    self._add((spec.name, group, site, "input", micro), stats)
                if check is not None:
                    self._add_check(check, stats, "in")
        outputs = spec.outputs(args, kwargs)
        if spec.name == "reduce" and src != self.rank:
            outputs = []  # only the destination's tensor holds the result
        return _Call(spec, group, ranks, site, micro, outputs, check, self.generation)

    def after(self, call: _Call, result: Any) -> None:
        if _coalescing():
            self.coalesced.append(call)  # the op only queued: its data moves at the block's exit
        elif call.spec.functional:
            waited = result.wait() if hasattr(result, "wait") else result
            call.outputs = [waited] if isinstance(waited, torch.Tensor) else []
            self._finish(call)
        elif call.outputs and hasattr(result, "get_future"):
            wait = call.spec.name not in _P2P and within_comm_hook()
            self._when_done(result, lambda: self._finish(call), wait=wait)
        else:
            self._finish(call)

    def before_batch(self, ops: list) -> list[_Call | None]:
        site = call_site()
        if not self._matched(site):
            return []
        calls: list[_Call | None] = []
        micro = self.micro()
        recv_micro: int | PendingMicro | None = None  # asked once: the batch's receives share it
        tags = PIPE.tensors  # a pipeline stage's ops say their micro-batch (one batch may mix several)
        for op in ops:
            name = "isend" if getattr(op.op, "__name__", "") == "isend" else "irecv"
            group, ranks = describe(op.group)
            if self.config.cc_log_only:
                self.sites[(f"batch_{name}", group, site)] += 1
                continue
            tagged = tags.get(id(op.tensor)) if tags else None
            if name == "isend":
                stats = self._stats([op.tensor], f"batch_{name}", group, site)
                if stats is UNREADABLE:
                    calls.append(None)
                    continue
                key = (f"batch_{name}", group, site, "input" if stats is not None else "calls")
                self._add((*key, micro if tagged is None else tagged), stats)
                calls.append(None)
            else:
                if tagged is None and recv_micro is None:
                    recv_micro = self.recv_micro()
                label = recv_micro if tagged is None else tagged
                spec = _BATCH_RECV
                calls.append(_Call(spec, group, ranks, site, label, [op.tensor], None, self.generation))
        return calls

    def after_batch(self, calls: list[_Call | None], works: Any) -> None:
        for call, work in zip(calls, works or []):
            if call is not None:
                self._when_done(work, lambda call=call: self._finish(call))

    def _when_done(self, work: Any, fn: Callable[[], None], wait: bool = False) -> None:
        """`fn` once `work` has completed: at once if its future is done (NCCL), at once after a wait if
        `wait` (a collective on gloo: the caller is held until the collective completes, as with
        `async_op=False`), else in a callback (on the backend's thread) or at the step's end (no future)."""
        try:
            future = work.get_future()
        except (RuntimeError, NotImplementedError, AttributeError):
            self.pending.append((work, fn))  # no future (gloo send/recv): read at the step's end
            return
        if wait and not future.done():
            # a callback would run after a waiter on the future has resumed (see the module's docstring)
            work.wait()
            fn()
            return

        finished, key = threading.Event(), next(self._keys)

        def done(_: Any) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - runs on the backend's thread
                self.fault("collective completion", exc)
            finally:
                finished.set()
                self.inflight.pop(key, None)  # nothing of a completed call is kept (its outputs)

        self.inflight[key] = (future, finished)
        future.then(done)

    def coalesced_done(self, cm: Any, async_ops: bool) -> None:
        calls, self.coalesced = self.coalesced, []
        works = [w for w in getattr(cm, "works", []) if w is not None] if async_ops else []
        for call in calls:
            if works:
                self._when_done(works[-1], lambda call=call: self._finish(call))
            else:
                self._finish(call)

    def settle(self) -> int:
        """At the step's end: the outputs of completed works that had no future, and the completion
        callbacks still running for completed ones (waited for: no sync, they only read host memory or
        enqueue device work); returns how many works had not completed (their statistics are dropped)."""
        left = 0
        deadline = time.monotonic() + CALLBACK_WAIT_S
        for future, finished in list(self.inflight.values()):
            if finished.is_set():
                continue
            # a done future's callback is running or about to: wait for it (the wait releases the GIL)
            if not future.done() or not finished.wait(max(0.0, deadline - time.monotonic())):
                left += 1
        self.inflight.clear()
        for call in self.coalesced:  # a coalescing block whose exit was not seen: read now
            self.pending.append((None, lambda call=call: self._finish(call)))
        self.coalesced = []
        for work, fn in self.pending:
            if work is None or work.is_completed():
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001
                    self.fault("collective completion", exc)
            else:
                left += 1
        self.pending = []
        return left

    def _finish(self, call: _Call) -> None:
        if call.generation != self.generation:
            return  # completed after its step was written
        if call.spec.name in _SEND:
            return  # no output: its input row (or "calls" row) counts the call
        stats = self._stats(call.outputs, call.spec.name, call.group, call.site) if call.outputs else None
        if stats is UNREADABLE:
            return
        if call.check is not None and stats is not None:
            self._add_check(call.check, stats, "out", call.generation)
        self._add((call.spec.name, call.group, call.site, "output", call.micro), stats, call.generation)

    # ==== sums ====================================================================================
    def _stats(self, tensors: list[torch.Tensor], op: str, group: str, site: str) -> Sum | None | object:
        """The summed statistics of a call's tensors (one engine call); None: no element (a tensorless
        row counts the call); `UNREADABLE`: a tensor the engine refuses (complex, ...), recorded as a fault
        (logged once per kind, naming this call): no row at all, on every rank alike (the dtype is the
        collective's), rather than a row of part of the payload or a tensorless one."""
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return None
        partials, skipped = self.compute(tensors)
        if skipped:
            why = next(iter(skipped.values()))
            self._fault(
                f"unreadable tensor ({why.kind}) in a collective",
                why,
                f"no comm row or check for {op}/{group}@{short(site)}; later such calls are counted only",
            )
            return UNREADABLE
        if len(tensors) > 1:  # a list argument: its tensors' partials combined, never a stacked copy
            row = partials[:1].clone()
            row[0, ADDITIVE] = partials[:, ADDITIVE].sum(0)
            row[0, MIN] = partials[:, MIN].min()
            row[0, MAX] = partials[:, MAX].max()
            partials = row
        numel = sum(t.numel() for t in tensors)
        shape = tuple(tensors[0].shape) if len(tensors) == 1 else (numel,)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return Sum(partials, 1, numel, nbytes, tensors[0].dtype, shape)

    def _add(self, key: tuple, stats: Sum | None, generation: int | None = None) -> None:
        with self.lock:
            if generation is not None and generation != self.generation:
                return  # completed (on the backend's thread) while its step was being written
            old = self.sums.get(key)
            if stats is None:  # a call with no tensor (barrier): counted
                stats = Sum(empty_partials(1), 1, 0, 0, torch.float32, ())
            if old is None:
                row = stats.row.clone()  # owned: later calls merge into it in place
                self.sums[key] = Sum(row, 1, stats.numel, stats.nbytes, stats.dtype, stats.shape)
                return
            merge_into(old.row, stats.row)
            old.calls += 1
            old.numel += stats.numel
            old.nbytes += stats.nbytes

    def _add_check(self, key: CheckKey, stats: Sum, side: str, generation: int | None = None) -> None:
        with self.lock:
            if generation is not None and generation != self.generation:
                return
            entry = self.check_entries.setdefault(key, CheckEntry(stats.dtype))
            row = getattr(entry, f"{side}_row")
            if row is None:
                setattr(entry, f"{side}_row", stats.row.clone())
            else:
                merge_into(row, stats.row)
            setattr(entry, f"{side}_numel", getattr(entry, f"{side}_numel") + stats.numel)

    def take(self) -> tuple[list[RowMeta], list[torch.Tensor], list[tuple[CheckKey, CheckEntry]]]:
        """The step's `comm` rows, named `{op}/{group}/{input|output|calls}@{site}`, and its check entries;
        the sums start again (one lock: a completion on the backend's thread lands in one step or the
        next, never half in each)."""
        with self.lock:
            sums, checks = self.sums, list(self.check_entries.items())
            self.sums, self.check_entries = {}, {}
            self.generation += 1
        if any(type(key[4]) is PendingMicro for key in sums):
            sums = settle_micro(sums)
        metas, parts = [], []
        for (op, group, site, io, micro), s in sums.items():
            name = f"{op}/{group}/{io}@{short(site)}"
            metas.append(RowMeta(FAMILY, 0, name, micro, s.shape, s.dtype, s.numel, "", s.calls, s.nbytes))
            parts.append(s.row)
        return metas, parts, checks


def _coalescing() -> bool:
    """A `_coalescing_manager` block is open (on some group): calls queue their ops."""
    from torch.distributed import distributed_c10d as c10d

    return bool(c10d._world.pg_coalesce_state)


_RECV = ("recv", "irecv")
_SEND = ("send", "isend")
_P2P = (*_SEND, *_RECV)


def _tagged(args: tuple, kwargs: dict) -> int | None:
    """The micro-batch a pipeline stage gave this p2p call's tensor (`pipe_passes`), if any."""
    tensor = args[0] if args else kwargs.get("tensor")
    return PIPE.tensors.get(id(tensor))


_BATCH_RECV = OpSpec("batch_irecv", "dist", "batch_isend_irecv", "batch_isend_irecv", list, list, list)
