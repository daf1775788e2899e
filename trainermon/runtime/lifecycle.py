"""A monitor's life in the process: weak links from process-wide registries, the flush at exit, the pid
guard for forked children, and the one-monitor-per-model check.

A monitor dropped without `close()` lives on while its model (whose hooks hold the step loop) lives, and
is flushed at exit. Nothing process-wide holds the loop strongly: torch's global optimizer hooks, the
scaler and clipping watches and the worker thread reach it through weak references. So once the user's
model and optimizer are garbage, the loop is too, and its finalizer stops the worker (after writing
everything queued), closes the sinks and the anomaly file. The exit handler keeps only those parts
(`_Ends`), never the loop or the model.

A forked child (os.fork, a DataLoader worker) inherits the parent's monitors, sinks and buffered rows but
not its threads: in another process `close()` and the exit handler touch nothing (the parent writes
those rows; a child flushing them again duplicates them, and a sink waiting for a thread the child lacks
hangs its exit).

A weakref callback or finalizer runs wherever the garbage collector runs: inside torch's iteration over
its global optimizer hooks (a collection triggered by an allocation in another global hook, or on another
thread), inside a wrapper of ours. It never removes anything from a process-wide registry itself: it
queues the removal (`later`), run at the next safe point (`settle`: set_monitor and close, on the
caller's thread). A collected monitor's hooks and wrappers are inert until then (they find it gone).

Costs: nothing per step; at attach, one finalizer and a scan of the live monitors (`same_target`).
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("trainermon")


def weak_method(method: Callable, on_dead: Callable[[], None] | None = None) -> Callable:
    """A function that calls the bound `method` through a weak reference to its object (then returns
    None): a process-wide registry holding it does not keep the object alive. `on_dead()` runs when the
    object is collected (to unregister the function). One weak dereference per call."""
    callback = None if on_dead is None else (lambda _ref: on_dead())
    ref, func = weakref.ref(method.__self__, callback), method.__func__  # not WeakMethod: slower per call

    def call(*args: Any, **kwargs: Any) -> Any:
        obj = ref()
        return None if obj is None else func(obj, *args, **kwargs)

    call.__name__ = getattr(method, "__name__", "call")
    return call


def weak_global_hook(
    register: Callable[[Callable], Any], method: Callable, wrap: Callable = lambda f: f
) -> Any:
    """`register(wrap(weak_method(method)))` (a global registry, e.g. torch's optimizer step hooks), whose
    handle is removed at the first `settle()` after `method`'s object is collected (never by the weakref
    callback: torch may be iterating the registry then). Returns that handle."""
    handles: list[Any] = []

    def unregister() -> None:
        for handle in handles:
            handle.remove()

    handles.append(register(wrap(weak_method(method, lambda: later(unregister)))))
    return handles[0]


#: removals asked for by weakref callbacks and finalizers, run by `settle` (appended atomically)
_PENDING: list[Callable[[], None]] = []


def later(removal: Callable[[], None]) -> None:
    """Queue `removal` for the next `settle()`: what a weakref callback or finalizer does instead of
    changing a process-wide registry (safe on any thread, at any point: one list append)."""
    _PENDING.append(removal)


def settle() -> None:
    """Run the queued removals of collected monitors (their global hooks, watches, patched functions).
    Called at set_monitor and close, on the caller's thread, outside any hook of torch's. Costs nothing
    when none is queued."""
    while _PENDING:
        try:
            removal = _PENDING.pop(0)
        except IndexError:  # another thread took the last one
            return
        try:
            removal()
        except Exception as exc:  # noqa: BLE001 - a removal failing leaves an inert hook; never raises
            logger.debug("trainermon: removing a collected monitor's hook failed: %s", exc)


class _Ends:
    """What ending a loop needs without the loop itself (which holds the model): its worker (the queued
    steps and the sinks), its anomaly detector and its dynamic control. Held by the exit handler."""

    def __init__(self, loop: Any) -> None:
        self.pid = os.getpid()
        self.loop = weakref.ref(loop)
        self.worker, self.detector, self.control = loop.worker, loop.detector, loop.control
        self.releases: list[Callable[[], None]] = []  # process-wide patches to undo (`on_drop`), queued

    def dropped(self) -> None:
        """The loop was collected unclosed (its model and optimizer are garbage): write what is queued and
        close. Runs where the garbage collector runs (any thread, the worker's own included: the worker
        then stops on its own and the exit handler waits for it)."""
        _ENDS.pop(id(self), None)
        if os.getpid() != self.pid:
            return
        for part in (self.control, self.worker, self.detector):
            try:
                if part is not None:
                    part.close()
            except Exception:  # noqa: BLE001, S110 - at shutdown; the monitor never raises into training
                pass
        if self.worker is not None and self.worker.stopping():
            _STOPPING.append(self.worker)
        for release in self.releases:  # a wrapper of ours may be running now: undone at `settle`
            later(release)


#: id(_Ends) -> the parts of each attached, unclosed loop of this process (strong: flushed at exit)
_ENDS: dict[int, _Ends] = {}
#: workers told to stop from their own thread (a finalizer run there), waited for at exit
_STOPPING: list[Any] = []
#: attached, unclosed loops (weak): a new monitor on the same model or optimizer closes the older one
_LIVE: weakref.WeakSet = weakref.WeakSet()


def track(loop: Any) -> Callable[[], None]:
    """Register an attached loop for the exit flush and for its finalizer. Returns `untrack()`, which
    `close()` calls (the parts are then closed by the loop itself)."""
    ends = _Ends(loop)
    _ENDS[id(ends)] = ends
    _LIVE.add(loop)
    final = weakref.finalize(loop, ends.dropped)
    final.atexit = False  # the exit handler below closes the live ones fully, in order
    # Re-registered last: it runs before the exit handlers registered since trainermon's import (as a
    # handler registered by the monitor itself would), while what the monitor writes with still works.
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)

    def untrack() -> None:
        final.detach()
        _ENDS.pop(id(ends), None)
        _LIVE.discard(loop)

    untrack.ends = ends  # type: ignore[attr-defined]  # for `on_drop`
    return untrack


def on_drop(untrack: Callable[[], None], release: Callable[[], None]) -> None:
    """`release()` (which must not hold the loop) is queued for `settle` once the loop of `untrack` is
    collected unclosed: process-wide patches a dropped monitor leaves (its collective wrappers)."""
    untrack.ends.releases.append(release)  # type: ignore[attr-defined]


def same_target(loop: Any, adapter: Any) -> list[Any]:
    """The live, attached loops of this process (other than `loop`) that monitor one of `adapter`'s model
    chunks or its optimizer."""
    mine = {id(m) for m in getattr(adapter, "chunks", ())}
    opt = getattr(adapter, "optimizer", None)
    found = []
    for other in list(_LIVE):
        theirs = other.adapter
        if other is loop or theirs is None or other.closed or not in_owner(other.pid):
            continue
        shared = mine & {id(m) for m in getattr(theirs, "chunks", ())}
        if shared or (opt is not None and getattr(theirs, "optimizer", None) is opt):
            found.append(other)
    return found


class Released:
    """What a closed loop keeps in place of its adapter (which holds the model chunks and the optimizer):
    the names it gave, for the read-only views and the in-memory metrics after `close()`. Not None, so
    that `set_monitor` on a closed monitor still says it was called."""

    chunks: tuple = ()
    optimizer: Any = None
    optimizer_chain: tuple = ()
    splits_model = False

    def __init__(self, adapter: Any) -> None:
        self.name = getattr(adapter, "name", "closed")
        self.chunk_types = tuple(type(c).__name__ for c in getattr(adapter, "chunks", ()))  # what it wrapped
        kinds = {}
        for per_micro_batch in (False, True):  # names only: no tensor read
            try:
                kinds[per_micro_batch] = adapter.msprobe_unreduced_kind(per_micro_batch)
            except Exception:  # noqa: BLE001 - at close; msprobe's default naming
                kinds[per_micro_batch] = "pre_grad"
        self._kinds = kinds

    def msprobe_unreduced_kind(self, per_micro_batch: bool) -> str:
        return self._kinds[bool(per_micro_batch)]

    def roots(self) -> list:
        return []

    def new_step(self) -> None:
        pass

    def close(self) -> None:
        pass


def release(loop: Any) -> None:
    """Drop what a closed loop holds of the model and optimizer (its adapter, the selected parameters,
    the probes with their module and parameter lists), so that a monitor kept after `close()` does not
    keep them alive; the read-only views (step, run_dir, faults, last_batch, dropped_rows) stay. Runs
    after the probes and the adapter are closed (their hooks removed). Cheap: a few attribute writes."""
    from .selection import ParamSelection

    if loop.adapter is not None and not isinstance(loop.adapter, Released):
        loop.adapter = Released(loop.adapter)
        loop.outputs.unreduced_kind = loop.adapter.msprobe_unreduced_kind  # was the adapter's bound method
    loop.selection = ParamSelection()
    loop.probes = []  # each closed; their lists of modules and parameters go with them
    loop._subscribers.clear()  # noqa: SLF001 - bound methods of the probes
    loop._joinables = None  # noqa: SLF001 - the monitored modules and optimizer (Join contexts)
    loop.collector.reset()  # rows of an unfinished step: views of the model's tensors


def in_owner(pid: int) -> bool:
    """This is the process that made the monitor (not a forked child)."""
    return os.getpid() == pid


def _at_exit() -> None:
    """Close every attached loop still open in this process (its steps are flushed), and wait for the
    workers of dropped loops that stop on their own."""
    pid = os.getpid()
    for ends in list(_ENDS.values()):
        if ends.pid != pid:
            continue  # a forked child: the parent writes these rows
        loop = ends.loop()
        try:
            if loop is not None:
                loop.close()
            else:
                ends.dropped()
        except Exception as exc:  # noqa: BLE001 - at exit: never a traceback instead of the others' flush
            logger.error("trainermon: closing a monitor at exit failed: %s", exc)
    for worker in _STOPPING:
        if worker.pid == pid:
            worker.wait_stopped()
    settle()


atexit.register(_at_exit)
