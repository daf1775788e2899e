"""torch.distributed.pipelining (torchtitan's pipeline parallelism) under the plain torch and FSDP2 adapters.

Two facts of a pipelined job change what the monitor must do (checked on torch 2.11 and 2.13, 2-4 gloo
ranks, GPipe, 1F1B and interleaved 1F1B, alone and with DDP or FSDP2 on the data-parallel dimension):

- Ranks hold different stages: different parameters under the same single-process names (torchtitan
  deletes the other stages' layers, so names keep their full FQNs). The global grad norm is then a sum over
  every stage, and a mesh dimension along which the stages differ ("pp") holds other tensors, not copies.
  `stage_map` finds this from the ranks' parameter names, once, at `set_monitor`.
- At its first step, `PipelineStage` runs its module once more to infer shapes (torch 2.11:
  `_shape_inference`; 2.13: `_forward_metadata_inference` and `_backward_metadata_inference`), with grad
  on and, on the later stages, on uninitialised `torch.empty` buffers. That run is no micro-batch of the
  step: `watch_stages` marks it (`side_pass`), so it writes no row and takes no micro-step.
- Zero-bubble schedules (`ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`) split a backward in
  two: an "input" pass, then a "weight" pass that runs autograd again from the nodes where the first met
  the parameters' subgraphs. `watch_stages` marks the weight pass (`replay`): the activation-gradient
  hooks of those nodes write no second row; the parameters' hooks fire there, as in any backward.
- The stage reduces a data-parallel module's gradients itself: it runs every DDP forward under
  `no_sync()` and prepares DDP's reducer by hand before the last backward; it keeps FSDP2 from reducing in
  backward and reduces in `perform_reduce_grad`. The adapters' pre-reduce taps, which follow DDP's and
  FSDP's own switches, would never fire: `on_stage_reduce` tells them when the stage is about to reduce.

Nothing here imports pipelining: it acts only when the job has imported it.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainermon.collect.key_union import digest_of
from trainermon.comm.pipe_passes import PIPE
from trainermon.names import clean_name
from trainermon.runtime.side_passes import replay, side_pass

logger = logging.getLogger("trainermon")

#: PipelineStage's methods that run the stage's module, or exchange p2p messages, for its own needs (no
#: micro-batch's data), by torch version (2.13's warm-up vote on static or dynamic shapes)
_METADATA_PASSES = (
    "_shape_inference",
    "_forward_metadata_inference",
    "_backward_metadata_inference",
    "_warmup_forward_vote",
    "_warmup_backward_result",
)


def in_use() -> bool:
    """Whether the job imported torch.distributed.pipelining (its stages exist only then)."""
    return "torch.distributed.pipelining.stage" in sys.modules


#: (kind, id(the stage's module)) -> what to call before the stage reduces its gradients. Kinds:
#: "last_backward" (DDP reduces inside the step's last backward), "reduce" (`perform_reduce_grad`)
_LISTENERS: dict[tuple[str, int], list[Callable[[], None]]] = {}


class _Listening:
    """The handle of an `on_stage_reduce` callback."""

    def __init__(self, key: tuple[str, int], callback: Callable[[], None]) -> None:
        self.key, self.callback = key, callback
        _LISTENERS.setdefault(key, []).append(callback)

    def remove(self) -> None:
        callbacks = _LISTENERS.get(self.key, [])
        if self.callback in callbacks:
            callbacks.remove(self.callback)


def on_stage_reduce(kind: str, module: torch.nn.Module, callback: Callable[[], None]) -> _Listening:
    """Call `callback` (which must not raise) when a PipelineStage whose module is `module` is about to
    reduce its gradients: at the start of its last backward ("last_backward", DDP) or of its
    `perform_reduce_grad` ("reduce", FSDP2)."""
    return _Listening((kind, id(module)), callback)


def watch_stages() -> None:
    """Wrap PipelineStage's shape/metadata inference in `side_pass`, a zero-bubble weight pass in `replay`,
    its reduce points to call the `on_stage_reduce` listeners, and its constructor to say when a stage
    that `stage_map` needed is built after it (`_say_late_stage`), and its passes and p2p ops to say their
    micro-batch (`trainermon.comm.pipe_passes`); once per process. Cost per step: a dict lookup and three
    attribute stores per pass of a stage; on steps the comm probe collects, a dict store per p2p op."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    if stage is None:
        return
    base = getattr(stage, "_PipelineStageBase", None)
    for cls in vars(stage).values():
        if not isinstance(cls, type) or cls.__module__ != stage.__name__:
            continue
        wrappers = _WRAPPERS
        if base is not None and issubclass(cls, base):  # not the module's other classes (_RecvInfo, ...)
            wrappers = {**_WRAPPERS, "__init__": _after_init}
        for name, wrap in wrappers.items():
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_trainermon", False):
                wrapped = functools.wraps(method)(wrap(method))
                wrapped._trainermon = True
                setattr(cls, name, wrapped)


def _as_side_pass(method: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with side_pass():
            return method(*args, **kwargs)

    return wrapped


def _tell(kind: str, module: Any) -> None:
    for callback in _LISTENERS.get((kind, id(module)), ()):
        try:
            callback()
        except Exception:  # noqa: BLE001 - the adapters' callbacks count their own faults
            logger.debug("trainermon: a pipeline reduce listener raised", exc_info=True)


def _before_last_backward(method: Any) -> Any:
    def wrapped(self: Any, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if last_backward and backward_type != "input":  # "input": no parameter gradient accumulates
            _tell("last_backward", self.submod)
        if backward_type == "weight":  # zero bubble: runs again nodes of this micro-batch's "input" pass
            with replay():
                return method(self, backward_type, bwd_kwargs, last_backward)
        return method(self, backward_type, bwd_kwargs, last_backward)

    return wrapped


def _before_reduce(method: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        _tell("reduce", self.submod)
        return method(self, *args, **kwargs)

    return wrapped


def _after_init(method: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        method(self, *args, **kwargs)
        if _UNSTAGED:
            try:
                _say_late_stage(self)
            except Exception:  # noqa: BLE001 - a message only: never in the way of building the stage
                logger.debug("trainermon: could not check a new pipeline stage", exc_info=True)

    return wrapped


#: PipelineStage's methods that build a micro-batch's p2p ops, taking its index first
_P2P_OPS = ("get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops")


def _forward_of(method: Any) -> Any:
    def wrapped(self: Any, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        PIPE.micro = chunk_id
        return method(self, chunk_id, *args, **kwargs)

    return wrapped


def _backward_of(method: Any) -> Any:
    def wrapped(self: Any, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        # gradients computed inside are micro-batch `chunk_id`'s (LoopedBFS runs backwards in reverse)
        PIPE.micro, outer, PIPE.backward = chunk_id, PIPE.backward, chunk_id
        try:
            return method(self, chunk_id, *args, **kwargs)
        finally:
            PIPE.backward = outer

    return wrapped


def _ops_of(method: Any) -> Any:
    def wrapped(self: Any, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        ops = method(self, chunk_id, *args, **kwargs)
        if PIPE.tagging:  # collected steps only: the schedule may batch one micro's sends with another's
            for op in ops:
                PIPE.tensors[id(op.tensor)] = chunk_id
        return ops

    return wrapped


_WRAPPERS: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(_METADATA_PASSES, _as_side_pass),
    "forward_one_chunk": _forward_of,
    **dict.fromkeys(("backward_one_chunk", "backward_weight_one_chunk"), _backward_of),
    **dict.fromkeys(_P2P_OPS, _ops_of),
    "backward_maybe_with_nosync": _before_last_backward,
    "perform_reduce_grad": _before_reduce,
}


@dataclass(frozen=True)
class StageMap:
    """Which ranks hold the same parameters (the same pipeline stage) as this one: a digest of each global
    rank's trainable parameter names."""

    rank: int
    digests: tuple[tuple[int, ...], ...]

    def splits(self) -> bool:
        """Ranks hold different parameters: no rank alone sees every row of the model."""
        return len(set(self.digests)) > 1

    def same_stage(self, ranks: Iterable[int]) -> bool:
        mine = self.digests[self.rank]
        return all(self.digests[r] == mine for r in ranks)


#: The bits of a rank's flag in `stage_map`'s all-gather
_USED, _FAILED, _NO_STAGE = 1, 2, 4
#: What every rank loses when one rank cannot take part in `stage_map` (its fallback is the one of a job
#: without pipeline stages, the same on every rank)
_FALLBACK = (
    "every rank takes the ranks for copies of one model, as without pipeline stages: where ranks hold "
    "different stages, the global grad norm is this stage's alone, and stages whose parameters have the "
    "same names are taken for one stage (one writes their rows)"
)
#: id(unwrapped monitored module) -> its weak reference, for the modules whose stages `stage_map` found
#: none of, where the map would need them (no rank's names differ): a stage built for one later is said
_UNSTAGED: dict[int, Any] = {}


def stage_map(
    roots: Sequence[torch.nn.Module],
    chunks: Sequence[torch.nn.Module] = (),
    group: Any = None,
    faults: Any = None,
    failed: bool = False,
) -> StageMap | None:
    """The job's `StageMap` when any rank uses pipelining, else None.

    Collective over `group` (a gloo group of every rank; None: not distributed, no collective): every rank
    calls it once, from `set_monitor`, whether or not it imported pipelining (ranks that differ in that
    would otherwise issue different collectives), and learns from the gathered flags whether any did. One
    all-gather of four int64 per rank, on the CPU. A rank's digest covers its trainable parameter names and
    the indices of the `PipelineStage`s that run `roots` or `chunks`: stages built as `nn.Sequential`
    parts have the same local names on every stage.

    Never raises. A rank that fails before the all-gather (here, or in the adapter's own preparation:
    `failed`) records it in `faults` and still takes part, flagged: then every rank returns None alike."""
    import torch.distributed as dist

    if group is None:
        return None
    used = in_use()
    flags, digest, indices = (_USED if used else 0) | (_FAILED if failed else 0), [0, 0, 0], []
    try:
        names = sorted(clean_name(n) for root in roots for n, p in root.named_parameters() if p.requires_grad)
        indices = _stage_indices([*roots, *chunks]) if used else []
        flags |= _NO_STAGE if used and not indices else 0
        digest = digest_of(json.dumps([names, indices]).encode())
    except Exception as exc:  # noqa: BLE001 - still take part in the collective, flagged
        _record(faults, exc)
        flags |= _FAILED
    try:
        every = [torch.zeros(4, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, torch.tensor([flags, *digest], dtype=torch.int64), group=group)
    except Exception as exc:  # noqa: BLE001 - the rows stay per stage, as before; said once
        logger.warning(
            "trainermon: could not compare the pipeline stages' parameters across ranks (%s); the global "
            "grad norm is this stage's alone",
            exc,
        )
        return None
    rows = [tuple(t.tolist()) for t in every]
    _UNSTAGED.clear()  # process-wide, as `dtensor.use_stage_map`: a previous monitor's modules go
    if not any(row[0] & _USED for row in rows):
        return None
    failing = [rank for rank, row in enumerate(rows) if row[0] & _FAILED]
    if failing:
        logger.warning(
            "trainermon: rank(s) %s could not prepare the comparison of the pipeline stages (their error is "
            "logged there): %s",
            failing,
            _FALLBACK,
        )
        return None
    stages = StageMap(dist.get_rank(group), tuple(row[1:] for row in rows))
    try:
        _say_missing_stages(rows, stages, [*roots, *chunks], flags)
    except Exception:  # noqa: BLE001 - messages only: the map stands, as on every rank
        logger.debug("trainermon: could not say which stages are missing", exc_info=True)
    return stages


def _record(faults: Any, exc: Exception) -> None:
    if faults is not None:
        faults.record("pipeline stage comparison", exc, _FALLBACK)
    else:
        logger.warning("trainermon: could not compare the pipeline stages (%s): %s", exc, _FALLBACK)


def _say_missing_stages(
    rows: Sequence[tuple[int, ...]], stages: StageMap, modules: Sequence[torch.nn.Module], flags: int
) -> None:
    """A job that imports pipelining without building stages (torchtitan always imports it) is told
    nothing: a warning is kept for where a missing stage makes the map wrong."""
    if not flags & _NO_STAGE:
        return
    if any(row[0] & _USED and not row[0] & _NO_STAGE for row in rows):
        # other ranks found their stages: this rank's digest differs from its own stage's copies
        logger.warning(
            "trainermon: other ranks run their monitored modules in PipelineStages, this one in none yet: "
            "build every rank's stages before set_monitor (the ranks of one stage are otherwise not "
            "taken for copies of each other)"
        )
        return
    logger.info(
        "trainermon: torch.distributed.pipelining is imported but no PipelineStage runs the monitored "
        "modules (a job without pipeline stages; a stage built later is said)"
    )
    if not stages.splits():  # no rank's names differ: only stage indices could tell the stages apart
        from .common import unwrap

        for module in modules:
            inner = unwrap(module)
            _UNSTAGED[id(inner)] = weakref.ref(inner)


def _say_late_stage(stage: Any) -> None:
    """Warn once when a PipelineStage is built after `stage_map` for a module it looked for."""
    from .common import unwrap

    submod = getattr(stage, "submod", None)
    if not isinstance(submod, torch.nn.Module):
        return
    ref = _UNSTAGED.get(id(unwrap(submod)))
    if ref is None or ref() is not unwrap(submod):
        return
    _UNSTAGED.clear()  # once
    logger.warning(
        "trainermon: a PipelineStage was built for a monitored module after set_monitor, and every rank's "
        "parameters have the same names: the ranks' stages are taken for one stage (one writes their rows, "
        "the global grad norm is this stage's alone). Build the stages before set_monitor"
    )


def _stage_kinds(base: type) -> set[type]:
    kinds, todo = set(), [base]
    while todo:
        cls = todo.pop()
        if cls not in kinds:
            kinds.add(cls)
            todo += cls.__subclasses__()
    return kinds


def _stage_indices(modules: Sequence[torch.nn.Module]) -> list[int]:
    """The `stage_index` of every PipelineStage whose module is one of `modules`, wrappers aside: a stage
    may run DDP(m) or torch.compile(m) where set_monitor got m, or the other way round. The stages exist
    before `set_monitor` and nothing lists them: they are found among the garbage collector's objects (one
    pass, once, only where pipelining is imported; a `gc.get_referrers` per module would be one pass each
    and sees no stage that runs a wrapper of the module)."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(stage, "_PipelineStageBase", None)
    if base is None:
        return []
    from .common import unwrap

    wanted = {id(unwrap(m)) for m in modules}
    kinds = _stage_kinds(base)
    found = set()
    for obj in gc.get_objects():
        if type(obj) in kinds:
            submod = getattr(obj, "submod", None)
            if isinstance(submod, torch.nn.Module) and id(unwrap(submod)) in wanted:
                found.add(int(obj.stage_index))
    return sorted(found)
