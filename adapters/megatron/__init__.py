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
- Parallel layouts (`layout.py`): a tensor-parallel parameter's optimizer-side values are pieces split
  over the tensor-parallel group (and the data-parallel group under the distributed optimizer), merged
  into the full parameter's statistics with its full shape; other parameters are copies over the
  tensor-parallel group. Expert parameters use the expert-tensor- and expert-data-parallel groups, as
  Megatron's buffers do. Exactly one rank writes each parameter. Parameters marked `shared` (a tied
  embedding's second copy on the last pipeline stage) are skipped, as Megatron leaves them out of its
  grad norm. Names are the single-process model's: global layer numbers on every pipeline stage and
  virtual chunk, global expert indices. A rank's own pre-reduce gradient of a tensor-parallel parameter
  is labelled with its shard (`Shard(0)[tp=1/2]`).
- The global gradient norm sums the written rows of every rank (the model is split over ranks), so it
  equals what Megatron's `step()` returns.

Megatron is imported only when a Megatron object is handed in (`detect` checks `sys.modules` first).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainermon.collect.placement import LOCAL, Placement, Sharded, TensorPiece
from trainermon.collect.records import StepScalars
from trainermon.copies import CopySafe
from trainermon.names import clean_name
from trainermon.runtime.clip_watch import torch_clip_entries

from ..base import GRAD_REDUCED, GRAD_UNREDUCED, PARAM, Adapter, AdapterContext, GradTaps, MonitoredParam
from ..common import Restore, guarded, hook_optimizer_step, unwrap
from .layout import MegatronLayout, global_renames, is_tp_sharded, rename
from .optimizer import Slot, build_slots, instance_copies

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


class MegatronAdapter(Adapter):
    name = "megatron"

    def msprobe_unreduced_kind(self, per_micro_batch: bool) -> str:
        return "acc_grad" if per_micro_batch else "pre_grad"  # msprobe patches Megatron's grad sync

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer: Any, context: AdapterContext) -> None:
        super().__init__(chunks, optimizer, context)
        from megatron.core.distributed import DistributedDataParallel

        self._ddps = [c for c in self.chunks if isinstance(c, DistributedDataParallel)]
        self._roots = [unwrap(c, _wrapper_types()) for c in self.chunks]
        self.layout = MegatronLayout.read().with_grouped_experts(self._roots)
        self._renames = [global_renames(root) for root in self._roots]
        self._params: list[MonitoredParam] | None = None
        self._attention_shards: dict | None = None  # module id -> labels, inside tensor-parallel attention
        self._slots: dict[int, Slot] | None = None
        self._param_dp_group: dict[int, Any] = {}
        for ddp in self._ddps:
            for buffer in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
                for p in buffer.param_index_map:
                    self._param_dp_group[id(p)] = buffer.data_parallel_group
        self._instance_copies = instance_copies(self._ddps, self.optimizer)
        self.dp_group = context.dp_group
        if self.dp_group is None and self._ddps:
            self.dp_group = getattr(self._ddps[0], "dp_cp_group", None)
        if self.dp_group is None:
            self.dp_group = self.layout.dp.group
        if self.dp_group is None and self.layout.splits_model:
            # Data parallelism of size 1 without Megatron's DDP: its real group, not None (the whole job
            # to a placement, which would make the tensor-parallel ranks copies of each other).
            from megatron.core import parallel_state as ps

            self.dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self._warn_missing_chunks()
        self._tapped: list[Any] = []  # bucket groups whose start_grad_sync is wrapped
        self._seen_groups: set[int] = set()
        self._loss_scale: Any = None

    @classmethod
    def owns_optimizer(cls, optimizer: Any) -> bool:
        return _megatron_imported() and _is_megatron_optimizer(optimizer)

    @classmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        if not _megatron_imported():
            return False
        from megatron.core.optimizer import MegatronOptimizer
        from megatron.core.transformer.module import MegatronModule

        wrappers = _wrapper_types()
        if isinstance(optimizer, MegatronOptimizer):
            return True
        if not any(isinstance(c, (*wrappers, MegatronModule)) for c in chunks):
            return False
        params = [p for c in chunks for p in c.parameters()]
        # main_grad: Megatron's DDP. Tensor-parallel pieces without it (a torch optimizer on Megatron's
        # parallel layers): only this adapter knows they are pieces of larger parameters.
        return any(hasattr(p, "main_grad") for p in params) or (
            MegatronLayout.read().tp.size > 1 and any(is_tp_sharded(p) for p in params)
        )

    # ---- model ---------------------------------------------------------------------------------
    def roots(self) -> list[torch.nn.Module]:
        return self._roots

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        return isinstance(module, _wrapper_types()) or unwrap(module) is not module

    def global_name(self, vpp_stage: int, name: str) -> str:
        return rename(name, self._renames[vpp_stage])

    @property
    def splits_model(self) -> bool:
        return self.layout.splits_model

    def coordinates(self) -> dict[str, list[int]]:
        return self.layout.coordinates()

    def token_placement(self) -> Placement:
        """A pipeline stage's tokens are split over its data (and context) parallel ranks and, as Megatron
        requires sequence parallelism for MoE with tensor parallelism, over its tensor-parallel ranks."""
        groups = [a.group for a in (self.layout.tp, self.layout.dp) if a.group is not None]
        return Sharded(*groups) if groups else LOCAL

    def activation_shards(self, module: torch.nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self._attention_shards is None:  # once: the modules inside tensor-parallel attention
            self._attention_shards = self.layout.attention_shards(self._roots)
        inside = self._attention_shards.get(id(module))
        return inside if inside is not None else self.layout.activation_shards(module)

    def parameters(self) -> list[MonitoredParam]:
        if self._params is None:
            out: list[MonitoredParam] = []
            seen: set[int] = set()
            for vpp_stage, root in enumerate(self._roots):
                for name, p in root.named_parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        name = self.global_name(vpp_stage, clean_name(name))
                        label = self.layout.shard_label(p)
                        out.append(MonitoredParam(len(out), vpp_stage, name, p, label))
            self._params = out
        return self._params

    def _warn_missing_chunks(self) -> None:
        """msprobe's documented insertion passes `model[0]` only: say what is not monitored."""
        expected = self.layout.vpp_size
        if expected > 1 and len(self._roots) < expected:
            logger.warning(
                "trainermon: %d of this stage's %d virtual-pipeline chunks were given to set_monitor; the "
                "layers of the others are not monitored (pass the whole model list to monitor them)",
                len(self._roots),
                expected,
            )

    # ---- the step ------------------------------------------------------------------------------
    def clip_entries(self) -> Sequence[Any]:
        """A Megatron optimizer clips after the pre event; a torch optimizer is clipped by the user."""
        return () if _is_megatron_optimizer(self.optimizer) else torch_clip_entries()

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

        optimizer.prepare_grads = patched_prepare = CopySafe(prepare_grads, original_prepare)
        optimizer.step = patched_step = CopySafe(step, original_step)
        return [
            Restore(optimizer, "step", patched_step),
            Restore(optimizer, "prepare_grads", patched_prepare),
        ]

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
    def _replica(self, p: torch.Tensor) -> Placement:
        dp_group = self._param_dp_group.get(id(p), self.dp_group)
        return self.layout.placement(
            p, dp_group, dp_sharded=False, copies=self._instance_copies.get(id(p), ())
        )

    def _build_slots(self) -> dict[int, Slot]:
        return build_slots(self.optimizer, self.layout, self._replica, self._instance_copies)

    def _slot(self, mp: MonitoredParam) -> Slot | None:
        if self._slots is None:
            self._slots = self._build_slots()
        if getattr(mp.param, "shared", False):
            return None  # a tied copy (the last stage's embedding): the first stage writes it
        return self._slots.get(id(mp.param))

    def _pieces(
        self, params: Sequence[MonitoredParam], read: Callable[[Slot, MonitoredParam], torch.Tensor | None]
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
        self, mp: MonitoredParam, read: Callable[[Slot, MonitoredParam], torch.Tensor | None]
    ) -> TensorPiece | None:
        """No optimizer was given (the user calls monitor.step()): read the model parameter itself."""
        if self.optimizer is not None or getattr(mp.param, "shared", False):
            return None
        slot = Slot(mp.param, None, self._replica(mp.param), self.layout.full_shape(mp.param))
        tensor = read(slot, mp)
        return None if tensor is None else TensorPiece(tensor, slot.placement, slot.full_shape, tensor.dtype)

    @staticmethod
    def _grad_of(slot: Slot, mp: MonitoredParam) -> torch.Tensor | None:
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

        def read_state(slot: Slot, mp: MonitoredParam) -> torch.Tensor | None:
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
        for mp, piece in zip(params, self.read(GRAD_REDUCED, params)):
            if piece is None or piece.tensor is None:
                out.append(None)
            else:  # this rank's own gradient (its tensor-parallel piece, labelled)
                tensor = piece.tensor
                out.append(TensorPiece(tensor, LOCAL, tuple(tensor.shape), piece.dtype, mp.local_shard))
        return out

    def new_step(self) -> None:
        self._seen_groups.clear()
