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
    handle is removed when `method`'s object is collected. Returns that handle."""
    handles: list[Any] = []

    def unregister() -> None:
        for handle in handles:
            handle.remove()

    handles.append(register(wrap(weak_method(method, unregister))))
    return handles[0]


class _Ends:
    """What ending a loop needs without the loop itself (which holds the model): its worker (the queued
    steps and the sinks), its anomaly detector and its dynamic control. Held by the exit handler."""

    def __init__(self, loop: Any) -> None:
        self.pid = os.getpid()
        self.loop = weakref.ref(loop)
        self.worker, self.detector, self.control = loop.worker, loop.detector, loop.control

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

    return untrack


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


atexit.register(_at_exit)
