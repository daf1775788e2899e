"""torch's Join context for uneven inputs (DDP's `model.join()`, `ZeroRedundancyOptimizer`): a rank that
ran out of batches leaves its training loop and shadows only the joinables' own collectives. Any other
collective from then on waits for that rank forever (or, on the joinables' group, meets a shadow and
corrupts it): the monitor's cross-rank summaries, communication checks and dynamic-control broadcast
pause in such a job; each rank's own rows go on."""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

logger = logging.getLogger("trainermon")


def joinables(adapter: Any) -> list[Any]:
    """What a Join context may be set up over: the monitored modules and optimizer, and, when none of them
    is a joinable, a wrapper holding a monitored module (`set_monitor(model.module)` under DDP), found
    once among live objects (~0.1 s on a large process; called once per run, with several ranks)."""
    modules = [*getattr(adapter, "chunks", ()), *adapter.roots()]
    found = [*modules, getattr(adapter, "optimizer", None)]
    if not any(hasattr(c, "_join_config") for c in found):
        held = {id(m) for m in modules}
        found += [
            obj
            for obj in gc.get_objects()
            if issubclass(type(obj), torch.nn.Module)  # type(): lazy proxies warn on __class__
            and hasattr(obj, "_join_config")
            and id(getattr(obj, "module", None)) in held
        ]
    return found


def joining(candidates: list[Any]) -> bool:
    """A Join context was set up over one of `candidates` (`joinables`). Every rank sets it up at the same
    point of its loop, so every rank sees the same answer at a step boundary. torch leaves the joinable's
    `_join_config.enable` set after the context exits (DDP keeps shadowing), so this stays true."""
    return any(getattr(getattr(c, "_join_config", None), "enable", False) for c in candidates)


def say_paused() -> None:
    logger.warning(
        "trainermon: a Join context for uneven inputs (DDP's model.join()) is on: cross-rank summaries, "
        "communication checks and dynamic switching pause for the rest of the run (a rank that has run "
        "out of inputs takes part in no other collective); each rank's own rows go on"
    )


# ==== who is still stepping ==========================================================================
# DDP's forward, under a Join context, all-reduces a one from each rank still stepping
# (`Join.notify_join_context`): its result is the number of such ranks. Kept here (a pass-through wrapper),
# it tells a rank, without a collective of the monitor's own, that it is the last one stepping: then the
# reduced gradient of a replicated parameter (the sum over the ranks still stepping, divided by the initial
# or the effective world size) is in this rank's `.grad`, exact, and it writes the rows rank 0 would.
_NOTICE: dict[str, Any] = {}  # "work", "group": the latest notification's
_WATCHERS: list[int] = [0]
_ORIGINAL: list[Any] = []


class _Unwatch:
    def __init__(self) -> None:
        self.removed = False

    def remove(self) -> None:
        if self.removed:
            return
        self.removed = True
        _WATCHERS[0] -= 1
        if _WATCHERS[0] == 0 and _ORIGINAL:
            from torch.distributed.algorithms.join import Join

            from trainermon.collect.placement import stepping_with_others

            Join.notify_join_context = staticmethod(_ORIGINAL.pop())
            _NOTICE.clear()
            stepping_with_others()


def watch_notices() -> _Unwatch:
    """Keep DDP's per-forward 'still stepping' all-reduce (once per process; `remove()` on the handle
    restores torch's function when no monitor watches). Cost: one Python call per forward, under Join only
    (installed when a Join context is seen)."""
    from torch.distributed.algorithms.join import Join

    if not _ORIGINAL:
        original = Join.notify_join_context

        def notify_join_context(joinable: Any) -> Any:
            work = original(joinable)
            if work is not None:
                _NOTICE["work"], _NOTICE["group"] = work, joinable.join_process_group
            return work

        _ORIGINAL.append(original)
        Join.notify_join_context = staticmethod(notify_join_context)
    _WATCHERS[0] += 1
    return _Unwatch()


def ranks_stepping() -> tuple[Any, int] | None:
    """(process group, number of its ranks still stepping) at this rank's latest forward under Join; None
    when unknown. Cost: a wait on a finished all-reduce and one scalar read (a device sync on an
    accelerator); called on collected steps only."""
    work = _NOTICE.get("work")
    if work is None:
        return None
    work.wait()
    return _NOTICE["group"], int(work.get_future().value()[0].item())


def check_stepping(loop: Any) -> None:
    """Under Join (else a flag check), on a collected step (`loop.on_grads_final`): when this rank is the
    last one stepping, it writes the rows of replicated tensors (rank 0 of the joinable's group, their
    writer, ran out of inputs) until more than one rank steps again (a later Join context, e.g. the next
    epoch's): then rank 0 writes them again; when some but not all ranks ran out, say that those rows may
    go unwritten (once per such period). Cost: `ranks_stepping`, on ranks other than the writer."""
    if not loop.joined or loop._stepping < 0 or "group" not in _NOTICE:
        return
    import torch.distributed as dist

    from trainermon.collect.placement import stepping_alone, stepping_with_others

    alone = loop._stepping == 1
    try:
        if dist.get_rank(_NOTICE["group"]) == 0:
            loop._stepping = -1  # the writer itself: nothing changes for it, never asked again
            return
        seen = ranks_stepping()
    except Exception as exc:  # noqa: BLE001
        loop.faults.record("counting the ranks still stepping", exc)
        loop._stepping = -1  # never asked again
        return
    if seen is None:
        return
    group, stepping = seen
    size = dist.get_world_size(group)
    if stepping == 1 and not alone:
        default = group is None or group is dist.distributed_c10d._get_default_group()
        stepping_alone(group, *((None, dist.group.WORLD) if default else ()))
        loop.collector._roles.clear()  # roles are cached per placement: this rank's changed
        say_sole(loop.rank)
    elif stepping > 1 and alone:
        # the ranks that ran out step again (the Join context ended): rank 0 writes those rows again,
        # else both would write them (and with different step numbers)
        stepping_with_others()
        loop.collector._roles.clear()
    if 1 < stepping < size and loop._stepping in (0, 1):
        say_unwritten(stepping, size)
    loop._stepping = stepping if stepping < size else 0


def say_sole(rank: int) -> None:
    logger.warning(
        "trainermon: rank %d is the last rank still stepping in a Join context (uneven inputs): from this "
        "step on it writes the rows of replicated tensors (grad_reduced, optimizer moments, param_*), "
        "which the ranks that ran out of inputs no longer write, until they step again (under this rank's "
        "own step numbers, which after uneven epochs differ from rank 0's)",
        rank,
    )


def say_unwritten(stepping: int, size: int) -> None:
    logger.warning(
        "trainermon: %d of the %d ranks of a Join context (uneven inputs) ran out of inputs: if its rank 0 "
        "is one of them, the rows of replicated tensors (grad_reduced, optimizer moments, param_*) of later "
        "steps are written by no rank until a single rank is left stepping",
        size - stepping,
        size,
    )
