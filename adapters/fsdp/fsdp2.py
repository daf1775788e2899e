"""FSDP2 (`fully_shard`), with or without a MixedPrecisionPolicy, checked on torch 2.13.

- grad_unreduced: FSDP2 unshards in a forward pre-hook that it prepends; a forward pre-hook of ours,
  registered after `fully_shard`, then finds the unsharded plain Parameters on the module and puts a
  post-accumulate-grad hook on each (once per object). It fires before FSDP2's post-backward
  reduce-scatter. Whether this backward reduces (`set_requires_gradient_sync`) and the gradient
  accumulated in the reduce dtype over earlier micro-batches are private: read in `_fsdp2_unit`.
  With tensor parallelism (FSDP2 over a TP-parallelized model) the unsharded parameter is itself a
  DTensor on the TP mesh: its gradient is this rank's TP piece, labelled.
- grad_reduced, exp_avg/exp_avg_sq, param: DTensors, placed over their mesh by `adapters/dtensor.py`
  (FSDP's `Shard`, TP's `Shard`, `_StridedShard` where FSDP shards a TP-sharded dimension again, HSDP's
  `Replicate` dimension): full-parameter statistics, one writer per job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainermon.collect.placement import LOCAL, Placement, Sharded, TensorPiece
from trainermon.names import clean_name
from trainermon.runtime.clip_watch import torch_clip_entries
from trainermon.runtime.side_passes import SIDE_PASSES

from ..base import GRAD_REDUCED, PARAM, Adapter, AdapterContext, GradTaps, MonitoredParam
from ..common import (
    AgreedRows,
    Handles,
    guarded,
    hook_optimizer_step,
    shard_groups,
    state_values,
    unscaled_grads,
    unwrap,
    wrapper_types,
)
from ..dtensor import (
    dtensor_piece,
    is_dtensor,
    placement_of,
    reduce_partials,
    splits_over_ranks,
)
from ..pipelining import StageMap, on_stage_reduce
from . import fsdp_imported
from .sums import ReduceSums

logger = logging.getLogger("trainermon")


@dataclass
class _Fsdp2Unit:
    reduces_gradients: Callable[[], bool]
    accumulated_grad: Callable[[torch.Tensor], torch.Tensor | None]


def _fsdp2_unit(module: torch.nn.Module) -> _Fsdp2Unit:
    """The two facts FSDP2 keeps private, read in one place.

    - whether the coming post-backward reduce-scatters (`set_requires_gradient_sync` has no getter);
    - the gradient accumulated over earlier micro-batches in the reduce dtype (with a mixed-precision
      policy whose reduce dtype differs from the param dtype, FSDP2 moves it off `.grad`).
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if callable(get_state) else None
    if state is None or not hasattr(state, "_fsdp_param_group"):
        raise RuntimeError(
            f"trainermon: FSDP2 in torch {torch.__version__} has no '_get_fsdp_state()._fsdp_param_group' "
            f"on {type(module).__name__}; the FSDP adapter is tested with torch 2.13"
        )

    def group() -> Any:
        return state._fsdp_param_group

    def reduces_gradients() -> bool:
        g = group()
        return True if g is None else bool(g.reduce_grads)

    def accumulated_grad(unsharded_param: torch.Tensor) -> torch.Tensor | None:
        g = group()
        for fsdp_param in [] if g is None else g.fsdp_params:
            if getattr(fsdp_param, "_unsharded_param", None) is unsharded_param:
                return fsdp_param.unsharded_accumulated_grad
        return None

    return _Fsdp2Unit(reduces_gradients, accumulated_grad)


def _pending_grad(unit: _Fsdp2Unit, p: torch.Tensor) -> torch.Tensor | None:
    """What FSDP2 is about to reduce-scatter for `p`: `.grad` plus what it accumulated off `.grad` in the
    reduce dtype over earlier micro-batches (transient)."""
    earlier = unit.accumulated_grad(p)
    if earlier is None:
        return p.grad
    return earlier if p.grad is None else earlier + p.grad


def _fsdp2_module_class() -> type | None:
    if not fsdp_imported():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


class Fsdp2Adapter(Adapter):
    """FSDP2 (`fully_shard`), with or without a MixedPrecisionPolicy."""

    name = "fsdp2"
    pipelined = True

    def msprobe_unreduced_kind(self, per_micro_batch: bool) -> str:
        return "pre_grad"  # msprobe patches FSDP's post-backward reduction, with monitor_mbs_grad too

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer: Any, context: AdapterContext) -> None:
        super().__init__(chunks, optimizer, context)
        module_cls = _fsdp2_module_class()
        assert module_cls is not None
        self._module_cls = module_cls
        self._wrappers = wrapper_types()
        self._roots = [unwrap(c) for c in self.chunks]
        self._stages: StageMap | None = None  # which ranks hold this pipeline stage: `agree`
        self._params: list[MonitoredParam] | None = None
        self._placement_of: dict[int, Placement] = {}
        # FSDP module -> [(index, owner module, attribute)] for the parameters it shards.
        self._managed: list[tuple[torch.nn.Module, list[tuple[int, torch.nn.Module, str]]]] = []
        self._hooked: dict[int, Any] = {}  # id(unsharded param) -> (param, handle)
        self._sums = ReduceSums("FSDP2")  # FSDP2 frees the unsharded gradient at each reduce
        self._taps: GradTaps | None = None
        self._agreed = AgreedRows()  # which sharded rows of optimizer state exist on some rank

    @classmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        module_cls = _fsdp2_module_class()
        return module_cls is not None and any(isinstance(m, module_cls) for c in chunks for m in c.modules())

    def roots(self) -> list[torch.nn.Module]:
        return self._roots

    @property
    def splits_model(self) -> bool:
        split = self._stages is not None and self._stages.splits()  # pipeline stages: other parameters
        return split or splits_over_ranks([mp.param for mp in self.parameters()])

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        return bool(self._wrappers) and isinstance(module, self._wrappers)

    def attach_step(self, events: Any) -> list[Any]:
        if self.optimizer is None:
            return []
        return hook_optimizer_step(self.optimizer, events)

    def clip_entries(self) -> Sequence[Any]:
        return torch_clip_entries()  # torch's clipping takes DTensor gradients (torchtitan's too)

    def parameters(self) -> list[MonitoredParam]:
        if self._params is not None:
            return self._params
        out: list[MonitoredParam] = []
        index_of: dict[int, int] = {}
        for vpp_stage, root in enumerate(self._roots):
            for name, p in root.named_parameters():
                if p.requires_grad:
                    index_of[id(p)] = len(out)
                    self._placement_of[len(out)] = placement_of(p) if is_dtensor(p) else LOCAL
                    out.append(MonitoredParam(len(out), vpp_stage, clean_name(name), p))
        # Each parameter belongs to its nearest enclosing fully_shard-ed module.
        for root in self._roots:
            self._collect_managed(root, None, index_of)
        self._params = out
        return out

    def _collect_managed(
        self, module: torch.nn.Module, fsdp_owner: list | None, index_of: dict[int, int]
    ) -> None:
        if isinstance(module, self._module_cls):
            fsdp_owner = []
            self._managed.append((module, fsdp_owner))
        if fsdp_owner is not None:
            for attr, p in module._parameters.items():
                if p is not None and id(p) in index_of:
                    fsdp_owner.append((index_of[id(p)], module, attr))
        for child in module.children():
            self._collect_managed(child, fsdp_owner, index_of)

    # ---- pre-reduce taps ---------------------------------------------------------------------
    def install_grad_taps(self, taps: GradTaps) -> list[Any]:

        self.parameters()
        handles = []
        self._taps = taps
        for fsdp_module, managed in self._managed:
            if not managed:
                continue
            unit = _fsdp2_unit(fsdp_module)

            def pre_hook(_module: torch.nn.Module, _args: Any, managed=managed, unit=unit) -> None:
                # Runs after FSDP2's own (prepended) pre-forward hook has unsharded the parameters.
                if not taps.active or not torch.is_grad_enabled():
                    return
                for index, owner, attr in managed:
                    p = owner._parameters.get(attr)
                    # the sharded parameter itself (FSDP2 has not unsharded it): nothing to tap
                    if p is None or p is self._params[index].param or id(p) in self._hooked:
                        continue
                    handle = p.register_post_accumulate_grad_hook(self._make_tap(index, unit, taps))
                    self._hooked[id(p)] = (p, handle)

            handles.append(
                fsdp_module.register_forward_pre_hook(guarded(self.context.faults, "FSDP2 tap", pre_hook))
            )
        report = guarded(self.context.faults, "FSDP2 pipeline tap", self._before_stage_reduce)
        for chunk in self.chunks:  # a pipeline stage reduces in `perform_reduce_grad`, not in backward
            inside = {id(m) for m in chunk.modules()}
            units = [(_fsdp2_unit(m), managed) for m, managed in self._managed if managed and id(m) in inside]
            handles.append(on_stage_reduce("reduce", chunk, lambda units=units: report(units, taps)))
        return handles

    def _before_stage_reduce(self, units: list[tuple[_Fsdp2Unit, list]], taps: GradTaps) -> None:
        """The gradients the stage is about to reduce-scatter: accumulated over its micro-batches."""
        if not taps.active:
            return
        for unit, managed in units:
            for index, owner, attr in managed:
                p = owner._parameters.get(attr)
                if p is None or p is self._params[index].param:  # resharded: nothing pending here
                    continue
                grad = _pending_grad(unit, p)
                if grad is not None:
                    self._sums.add([index], [grad], taps.on_unreduced)

    def report_held_unreduced(self) -> None:
        if self._taps is not None:
            self._sums.flush(self._taps.on_unreduced)

    @property
    def taps_report_unreduced(self) -> bool:
        return True

    def _make_tap(self, index: int, unit: _Fsdp2Unit, taps: GradTaps):
        def tap(p: torch.Tensor) -> None:
            if not taps.active or p.grad is None or SIDE_PASSES.depth:  # a pipeline's shape inference
                return
            if not unit.reduces_gradients():
                return  # accumulating without sync: reported at the backward that reduces
            grad = _pending_grad(unit, p)
            if grad is not None:
                self._sums.add([index], [grad], taps.on_unreduced)

        return guarded(self.context.faults, "FSDP2 gradient tap", tap)

    def new_step(self) -> None:
        self._sums.clear()

    def install_microbatch_taps(self, params: Sequence[MonitoredParam], taps: GradTaps) -> list[Any]:
        # Each micro-batch's own gradient: a tensor hook on the unsharded parameter (fires before it is
        # accumulated into `.grad`), registered once per step and object in a forward pre-hook.

        self.parameters()
        wanted = {mp.index for mp in params}
        group = Handles()
        hooked: set[int] = set()
        for fsdp_module, managed in self._managed:
            mine = [m for m in managed if m[0] in wanted]
            if not mine:
                continue

            def pre_hook(_module: torch.nn.Module, _args: Any, mine=mine) -> None:
                if not torch.is_grad_enabled():
                    return
                for index, owner, attr in mine:
                    p = owner._parameters.get(attr)
                    if p is None or p is self._params[index].param or id(p) in hooked:
                        continue
                    hooked.add(id(p))
                    group.items.append(p.register_hook(lambda g, index=index: taps.on_microbatch(index, g)))

            hook = guarded(self.context.faults, "FSDP2 tap", pre_hook)
            group.items.append(fsdp_module.register_forward_pre_hook(hook))
        return [group]

    # ---- optimizer-side tensors --------------------------------------------------------------
    def _piece(self, mp: MonitoredParam, value: torch.Tensor | None) -> TensorPiece | None:
        if value is None:
            return None
        if is_dtensor(value):
            return dtensor_piece(value)
        return TensorPiece(value, self._placement_of[mp.index], tuple(mp.param.shape), value.dtype)

    def read(self, kind: str, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        if kind == GRAD_REDUCED:  # Partial gradients (sequence parallelism's norms) reduced together
            # a fused optimizer's loss scale (GradScaler without unscale_) is divided out as its kernel does
            grads = unscaled_grads(self.optimizer, reduce_partials([mp.param.grad for mp in params]))
            return [self._piece(mp, g) for mp, g in zip(params, grads)]
        if kind == PARAM:
            return [self._piece(mp, mp.param.detach()) for mp in params]
        return self._optimizer_state(params, kind)

    def _optimizer_state(self, params: Sequence[MonitoredParam], key: str) -> list[TensorPiece | None]:
        values = state_values(self.optimizer, [mp.param for mp in params], key)
        # A sharded row exists where some rank holds the state (agreed over the ranks: a parameter that
        # never had a gradient has none anywhere, and a row of no elements is no statistic).
        ask = [i for i, mp in enumerate(params) if isinstance(self._placement_of[mp.index], Sharded)]
        held = [False] * len(params)
        if ask:
            groups = shard_groups(self._placement_of[params[i].index] for i in ask)
            local = [values[i] is not None for i in ask]
            found = self._agreed.state(
                key, [params[i].index for i in ask], local, groups, params[ask[0]].param.device
            )
            for i, on in zip(ask, found):
                held[i] = on
        out: list[TensorPiece | None] = []
        for mp, value, on in zip(params, values, held):
            piece = self._piece(mp, value)
            if piece is None and on:
                # Keep the row on every rank so the packed reduction lines up.
                # empty, on the parameter's device: where the other ranks' pieces are (CPU under offload)
                empty = torch.empty(0, dtype=mp.param.dtype, device=mp.param.device)
                out.append(
                    TensorPiece(empty, self._placement_of[mp.index], tuple(mp.param.shape), mp.param.dtype)
                )
            else:
                out.append(piece)
        return out

    def close(self) -> None:
        for _p, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
