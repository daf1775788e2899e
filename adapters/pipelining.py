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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainermon.collect.key_union import digest_of
from trainermon.names import clean_name
from trainermon.runtime.side_passes import replay, side_pass

logger = logging.getLogger("trainermon")

#: PipelineStage's methods that run the stage's module for its own needs, by torch version
_METADATA_PASSES = ("_shape_inference", "_forward_metadata_inference", "_backward_metadata_inference")


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
    and its reduce points to call the `on_stage_reduce` listeners; once per process. Cost per step: a dict
    lookup per backward of a stage."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    if stage is None:
        return
    for cls in vars(stage).values():
        if not isinstance(cls, type) or cls.__module__ != stage.__name__:
            continue
        for name, wrap in _WRAPPERS.items():
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


_WRAPPERS: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(_METADATA_PASSES, _as_side_pass),
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


def stage_map(
    roots: Sequence[torch.nn.Module], chunks: Sequence[torch.nn.Module] = (), group: Any = None
) -> StageMap | None:
    """The job's `StageMap` when any rank uses pipelining, else None.

    Collective over `group` (a gloo group of every rank; None: not distributed, no collective): every rank
    calls it once, from `set_monitor`, whether or not it imported pipelining (ranks that differ in that
    would otherwise issue different collectives), and learns from the gathered flags whether any did. One
    all-gather of four int64 per rank, on the CPU. A rank's digest covers its trainable parameter names and
    the indices of the `PipelineStage`s that run `roots` or `chunks`: stages built as `nn.Sequential`
    parts have the same local names on every stage."""
    import torch.distributed as dist

    if group is None:
        return None
    try:
        names = sorted(clean_name(n) for root in roots for n, p in root.named_parameters() if p.requires_grad)
        used = in_use()
        mine = [
            int(used),
            *digest_of(json.dumps([names, _stage_indices([*roots, *chunks]) if used else []]).encode()),
        ]
    except Exception:  # noqa: BLE001 - still take part in the collective, as a rank without stages
        logger.debug("trainermon: could not digest this rank's parameters", exc_info=True)
        mine = [0, 0, 0, 0]
    try:
        every = [torch.zeros(4, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, torch.tensor(mine, dtype=torch.int64), group=group)
    except Exception as exc:  # noqa: BLE001 - the rows stay per stage, as before; said once
        logger.warning(
            "trainermon: could not compare the pipeline stages' parameters across ranks (%s); the global "
            "grad norm is this stage's alone",
            exc,
        )
        return None
    rows = [tuple(t.tolist()) for t in every]
    if not any(row[0] for row in rows):
        return None
    return StageMap(dist.get_rank(group), tuple(row[1:] for row in rows))


def _stage_indices(modules: Sequence[torch.nn.Module]) -> list[int]:
    """The `stage_index` of every PipelineStage whose module is one of `modules`. The stages exist before
    `set_monitor` and nothing lists them: they are found among the objects that refer to the modules (a
    scan of the garbage collector's objects per module, once, only where pipelining is imported)."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(stage, "_PipelineStageBase", None)
    if base is None:
        return []
    found = set()
    for module in {id(m): m for m in modules}.values():
        for ref in gc.get_referrers(module):
            # a stage's attributes live in its __dict__ (the referrer then) or inline in the object
            owners = gc.get_referrers(ref) if isinstance(ref, dict) and ref.get("submod") is module else [ref]
            for owner in owners:
                if isinstance(owner, base) and getattr(owner, "submod", None) is module:
                    found.add(int(owner.stage_index))
    if not found:
        logger.warning(
            "trainermon: torch.distributed.pipelining is imported but no PipelineStage runs the monitored "
            "modules yet: if this job pipelines, build its stages before set_monitor (stages whose "
            "parameters have the same names are otherwise taken for one stage)"
        )
    return sorted(found)
