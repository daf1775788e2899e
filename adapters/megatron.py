"""Megatron-Core (checked against megatron-core 0.16.1): DDP with main_grad buffers; FP32Optimizer,
Float16OptimizerWithFloat16Params and DistributedOptimizer, bare or inside a ChainedOptimizer.

Where each family is read:

- grad_unreduced: a tap on each bucket group's `start_grad_sync` (wrapped per instance). Megatron calls
  it exactly once per step and bucket group, right before the data-parallel all-reduce/reduce-scatter and
  before it scales the bucket by 1/dp: from `finalize_model_grads` when `overlap_grad_reduce` is off, and
  from the backward hook of the bucket group's last ready parameter when it is on. At that moment each
  parameter's `main_grad` (a view into the bucket) holds this rank's local gradient accumulated over every
  micro-batch of the step, including gradients that Megatron wrote there directly (fused wgrad). The tap
  computes statistics of those views in place: no copy of any gradient is kept. With `monitor_mbs_grad`
  each micro-batch's own gradient comes from a tensor hook on the parameter (autograd calls it with the
  incoming gradient before AccumulateGrad; it does not see gradients fused straight into main_grad).
  The loss scale is not divided out of grad_unreduced (it is the raw tensor Megatron reduces).
- grad_reduced, exp_avg, exp_avg_sq, param: read from the optimizer's own fp32 tensors. The adapter wraps
  the optimizer's `prepare_grads` and `step` per instance and the core's pre-step hooks run right after
  `prepare_grads`: the reduced gradient has been copied into the main parameters' `.grad` and unscaled,
  and it is not clipped yet. FP32Optimizer: the model parameter (its `.grad` is `main_grad`).
  Float16OptimizerWithFloat16Params: the full fp32 master copy. DistributedOptimizer: this rank's 1-D fp32
  shard of the master, which covers `_get_model_param_range_map(p)["param"]` of the flattened parameter;
  these are `Sharded` pieces merged over the optimizer's data-parallel group in the core's one packed
  reduction (a rank that owns no elements of a parameter contributes an empty row). Nothing is gathered.
- step scalars: `loss_scale` (read before `prepare_grads` updates a dynamic scaler) and what the
  optimizer's own `step()` returns: its grad norm and whether it skipped the update.
- Replicated values are written by the first rank of the parameter's data-parallel group (expert
  parameters use their own expert-data-parallel group, as Megatron's buffers do). Parameters duplicated
  across tensor-parallel ranks (not `tensor_model_parallel`) are written for the optimizer-side families
  only on tensor-parallel rank 0, and parameters marked `shared` (a tied embedding's second copy on the
  last pipeline stage) are skipped there, exactly as Megatron leaves them out of its grad norm.

Megatron is imported only when a Megatron object is handed in (`detect` checks `sys.modules` first).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainermon.collect.placement import LOCAL, Placement, Replicated, Sharded, TensorPiece
from trainermon.collect.records import StepScalars
from trainermon.names import clean_name

from .base import GRAD_REDUCED, GRAD_UNREDUCED, PARAM, Adapter, AdapterContext, GradTaps, MonitoredParam
from .common import Restore, guarded, hook_optimizer_step, unwrap

logger = logging.getLogger("trainermon")


def _megatron_imported() -> bool:
    # Only a process that imported megatron.core can hold Megatron objects; everyone else skips the import.
    return "megatron.core" in sys.modules


def _wrapper_types() -> tuple[type, ...]:
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.transformer.module import Float16Module

    return (_BaseDataParallel, Float16Module)


def _is_megatron_optimizer(optimizer: Any) -> bool:
    if optimizer is None:
        return False
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


def _leaf_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside a (possibly nested) ChainedOptimizer, or the optimizer itself."""
    from megatron.core.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return [leaf for inner in optimizer.chained_optimizers for leaf in _leaf_optimizers(inner)]
    return [optimizer]


@dataclass(frozen=True)
class _Slot:
    """Where the optimizer keeps one model parameter: its fp32 master (the full tensor, or this rank's
    shard, or None when this rank owns no element) and the torch optimizer whose state it keys."""

    master: torch.Tensor | None
    inner: Any  # torch.optim.Optimizer holding the state
    placement: Placement
    full_shape: tuple[int, ...]


class MegatronAdapter(Adapter):
    name = "megatron"

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer: Any, context: AdapterContext) -> None:
        super().__init__(chunks, optimizer, context)
        from megatron.core.distributed import DistributedDataParallel

        self._ddps = [c for c in self.chunks if isinstance(c, DistributedDataParallel)]
        self._roots = [unwrap(c, _wrapper_types()) for c in self.chunks]
        self._params: list[MonitoredParam] | None = None
        self._slots: dict[int, _Slot] | None = None
        self._duplicate: dict[int, bool] = {}
        self._param_dp_group: dict[int, Any] = {}
        for ddp in self._ddps:
            for buffer in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
                for p in buffer.param_index_map:
                    self._param_dp_group[id(p)] = buffer.data_parallel_group
        self.dp_group = context.dp_group
        if self.dp_group is None and self._ddps:
            self.dp_group = getattr(self._ddps[0], "dp_cp_group", None)
        self._tapped: list[Any] = []  # bucket groups whose start_grad_sync is wrapped
        self._seen_groups: set[int] = set()
        self._loss_scale: Any = None

    @classmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        if not _megatron_imported():
            return False
        from megatron.core.optimizer import MegatronOptimizer
        from megatron.core.transformer.module import MegatronModule

        wrappers = _wrapper_types()
        if isinstance(optimizer, MegatronOptimizer):
            return True
        return any(isinstance(c, (*wrappers, MegatronModule)) for c in chunks) and any(
            hasattr(p, "main_grad") for c in chunks for p in c.parameters()
        )

    # ---- model ---------------------------------------------------------------------------------
    def roots(self) -> list[torch.nn.Module]:
        return self._roots

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        return isinstance(module, _wrapper_types()) or unwrap(module) is not module

    def parameters(self) -> list[MonitoredParam]:
        if self._params is None:
            out: list[MonitoredParam] = []
            seen: set[int] = set()
            for vpp_stage, root in enumerate(self._roots):
                for name, p in root.named_parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        out.append(MonitoredParam(len(out), vpp_stage, clean_name(name), p))
            self._params = out
        return self._params

    # ---- the step ------------------------------------------------------------------------------
    def attach_step(self, events: Any) -> list[Any]:
        """Megatron optimizers: the pre event fires inside `step()` right after `prepare_grads()` (reduced,
        unscaled, not yet clipped gradients), the post event after `step()` returns, with its results.
        A torch optimizer (no Megatron wrapper) gets torch's step hooks."""
        optimizer = self.optimizer
        if optimizer is None:
            return []
        if not _is_megatron_optimizer(optimizer):
            return hook_optimizer_step(optimizer, events)
        original_step, original_prepare = optimizer.step, optimizer.prepare_grads
        adapter = self
        state = {"in_step": False, "pre_fired": False}

        def prepare_grads(*args: Any, **kwargs: Any) -> Any:
            if state["in_step"]:
                adapter._capture_loss_scale()
            found_inf = original_prepare(*args, **kwargs)
            if state["in_step"] and not state["pre_fired"]:
                state["pre_fired"] = True
                events.pre()
            return found_inf

        def step(*args: Any, **kwargs: Any) -> Any:
            state["in_step"], state["pre_fired"] = True, False
            try:
                out = original_step(*args, **kwargs)
            finally:
                state["in_step"] = False
            if not state["pre_fired"]:  # a step that never prepared its gradients: report them late
                state["pre_fired"] = True
                events.pre()
            events.post(adapter._scalars(out))
            return out

        optimizer.prepare_grads = prepare_grads
        optimizer.step = step
        return [Restore(optimizer, "step", step), Restore(optimizer, "prepare_grads", prepare_grads)]

    def _capture_loss_scale(self) -> None:
        # A reference, no computation: Megatron's scalers replace the scale tensor on update (never in
        # place), so this still reads the scale the step's gradients carry when the worker reads it.
        try:
            self._loss_scale = self.optimizer.get_loss_scale()
        except Exception:  # noqa: BLE001 - a missing scale must not stop the step
            self._loss_scale = None

    def _scalars(self, out: Any) -> StepScalars:
        scale = self._loss_scale
        if isinstance(scale, torch.Tensor):
            scale = scale.detach().reshape(-1)[0]  # read by the worker, never here (a device sync)
        norm = skipped = None
        if isinstance(out, tuple) and len(out) >= 2:
            ok, grad_norm = out[0], out[1]
            norm = float("nan") if grad_norm is None else float(grad_norm)
            skipped = not ok
        return StepScalars(loss_scale=scale, optimizer_grad_norm=norm, update_skipped=skipped)

    # ---- where the optimizer keeps each parameter -----------------------------------------------
    def _replica(self, p: torch.Tensor) -> Replicated:
        return Replicated(self._param_dp_group.get(id(p), self.dp_group))

    def _build_slots(self) -> dict[int, _Slot]:
        from megatron.core.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        slots: dict[int, _Slot] = {}
        leaves = _leaf_optimizers(self.optimizer) if self.optimizer is not None else []
        for leaf in leaves:
            inner = getattr(leaf, "optimizer", None)
            if getattr(leaf, "is_stub_optimizer", False) or inner is None:
                continue
            if isinstance(leaf, DistributedOptimizer):
                group = Sharded(leaf.data_parallel_group)
                owned: dict[int, torch.Tensor] = {}
                for models, shards in (
                    (leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups),
                    (leaf.model_fp32_groups, leaf.shard_fp32_groups),
                ):
                    for model_group, shard_group in zip(models, shards):
                        for p, shard in zip(model_group, shard_group):
                            owned[id(p)] = shard
                # Every parameter of the optimizer's buffers gets a row on every rank (collective order).
                for buffer in leaf.buffers:
                    for p in buffer.param_index_map:
                        slots[id(p)] = _Slot(owned.get(id(p)), inner, group, tuple(p.shape))
            elif isinstance(leaf, Float16OptimizerWithFloat16Params):
                for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                    for p, main in zip(model_group, main_group):
                        slots[id(p)] = _Slot(main, inner, self._replica(p), tuple(p.shape))
                for group in leaf.fp32_from_fp32_groups:
                    for p in group:
                        slots[id(p)] = _Slot(p, inner, self._replica(p), tuple(p.shape))
            elif isinstance(leaf, FP32Optimizer):
                for group in inner.param_groups:
                    for p in group["params"]:
                        slots[id(p)] = _Slot(p, inner, self._replica(p), tuple(p.shape))
            else:
                logger.warning(
                    "trainermon: unknown Megatron optimizer %s; its tensors are skipped", type(leaf)
                )
        return slots

    def _slot(self, mp: MonitoredParam) -> _Slot | None:
        if self._slots is None:
            self._slots = self._build_slots()
            self._duplicate = {mp.index: self._is_duplicate(mp.param) for mp in self.parameters()}
        if self._duplicate.get(mp.index, False):
            return None
        return self._slots.get(id(mp.param))

    def _is_duplicate(self, p: torch.Tensor) -> bool:
        """Written by another rank already: a TP-replicated copy on TP rank > 0, or a `shared` copy."""
        if getattr(p, "shared", False):
            return True
        if getattr(p, "tensor_model_parallel", False):
            return False
        import torch.distributed as dist

        tp_group = self.context.tp_group
        if tp_group is not None and dist.is_initialized():
            return dist.get_rank(group=tp_group) != 0
        try:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                return parallel_state.get_tensor_model_parallel_rank() != 0
        except Exception:  # noqa: BLE001 - no parallel state: no tensor parallelism
            pass
        return False

    def _pieces(
        self, params: Sequence[MonitoredParam], read: Callable[[_Slot, MonitoredParam], torch.Tensor | None]
    ) -> list[TensorPiece | None]:
        out: list[TensorPiece | None] = []
        for mp in params:
            slot = self._slot(mp)
            if slot is None:
                out.append(self._fallback(mp, read))
                continue
            tensor = read(slot, mp) if slot.master is not None else None
            if isinstance(slot.placement, Sharded):
                # Every rank adds the row, holding elements or not, so the packed reduction lines up.
                dtype = tensor.dtype if tensor is not None else torch.float32
                out.append(TensorPiece(tensor, slot.placement, slot.full_shape, dtype))
            elif tensor is not None:
                out.append(TensorPiece(tensor, slot.placement, slot.full_shape, tensor.dtype))
            else:
                out.append(None)
        return out

    def _fallback(
        self, mp: MonitoredParam, read: Callable[[_Slot, MonitoredParam], torch.Tensor | None]
    ) -> TensorPiece | None:
        """No optimizer was given (the user calls monitor.step()): read the model parameter itself."""
        if self.optimizer is not None or self._is_duplicate(mp.param):
            return None
        tensor = read(_Slot(mp.param, None, self._replica(mp.param), tuple(mp.param.shape)), mp)
        return None if tensor is None else TensorPiece.whole(tensor, self._replica(mp.param))

    @staticmethod
    def _grad_of(slot: _Slot, mp: MonitoredParam) -> torch.Tensor | None:
        master = slot.master
        assert master is not None
        grad = master.grad
        if grad is None:
            grad = getattr(master, "decoupled_grad", None)  # precision-aware optimizer
        if grad is None and master is mp.param:
            grad = getattr(mp.param, "main_grad", None)  # no Megatron optimizer: the reduced main_grad
        return grad

    def read(self, kind: str, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        if kind == GRAD_REDUCED:
            return self._pieces(params, self._grad_of)
        if kind == GRAD_UNREDUCED:
            return self._unreduced_at_step(params)
        if kind == PARAM:
            return self._pieces(
                params, lambda slot, mp: slot.master.data if slot.master is not None else None
            )

        def read_state(slot: _Slot, mp: MonitoredParam) -> torch.Tensor | None:
            if slot.inner is None:
                return None
            value = slot.inner.state.get(slot.master, {}).get(kind)
            return value if isinstance(value, torch.Tensor) else None

        return self._pieces(params, read_state)

    # ---- pre-reduce gradients ------------------------------------------------------------------
    def install_grad_taps(self, taps: GradTaps) -> list[Any]:
        index_of = {id(mp.param): mp.index for mp in self.parameters()}
        handles = []
        for ddp in self._ddps:
            groups = list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))
            for bucket_group in groups:
                handles.append(self._tap_bucket_group(bucket_group, taps, index_of))
        return handles

    @property
    def taps_report_unreduced(self) -> bool:
        return bool(self._tapped)

    def _tap_bucket_group(self, bucket_group: Any, taps: GradTaps, index_of: dict[int, int]) -> Any:
        original = bucket_group.start_grad_sync
        report = guarded(self.context.faults, "Megatron gradient tap", self._report_group)

        def start_grad_sync(*args: Any, **kwargs: Any) -> Any:
            # Before the original: the buckets still hold this rank's accumulated, unscaled local grads.
            if taps.active and id(bucket_group) not in self._seen_groups:
                self._seen_groups.add(id(bucket_group))
                report(bucket_group, taps, index_of)
            return original(*args, **kwargs)

        bucket_group.start_grad_sync = start_grad_sync
        self._tapped.append(bucket_group)
        return Restore(bucket_group, "start_grad_sync", start_grad_sync)

    @staticmethod
    def _report_group(bucket_group: Any, taps: GradTaps, index_of: dict[int, int]) -> None:
        indices, grads = [], []
        for bucket in bucket_group.buckets:
            for p in bucket.params_list:
                i = index_of.get(id(p))
                if i is not None:
                    indices.append(i)
                    grads.append(p.main_grad)
        if indices:
            taps.on_unreduced(indices, grads)

    def _unreduced_at_step(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        # No Megatron DDP: nothing is reduced, so the local gradient is the one the optimizer sees.
        out: list[TensorPiece | None] = []
        for piece in self.read(GRAD_REDUCED, params):
            if piece is None or piece.tensor is None or isinstance(piece.placement, Sharded):
                out.append(None)
            else:
                out.append(TensorPiece(piece.tensor, LOCAL, piece.full_shape, piece.dtype))
        return out

    def new_step(self) -> None:
        self._seen_groups.clear()
