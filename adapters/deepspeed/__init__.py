"""DeepSpeed: the engine with ZeRO stages 0, 1, 2 and 3 (checked on deepspeed 0.19.8 on CPU with gloo).

What is hooked
- The step: the engine's `_take_model_step` (it runs once per real optimizer step, at the accumulation
  boundary, also when the step is then skipped on overflow). The adapter wraps it on the engine instance
  and fires the pre event before it (so before DeepSpeed's gradient clipping) and the post event after
  the update, with the loss scale and whether the update was skipped. Whatever optimizer the user passes
  (the engine, `engine.optimizer`, Accelerate's wrapper, the basic torch optimizer), the step is the
  same.
- grad_unreduced: autograd hooks on `engine.module`'s parameters, which see the local gradient before
  DeepSpeed reduces it. Where DeepSpeed leaves `.grad` accumulating over micro-batches and reduces only at
  the boundary (stage 0, ZeRO-1 with DeepSpeedZeroOptimizer) a post-accumulate-grad hook reads `.grad` at
  the boundary micro-batch. Where it reduces every micro-batch and frees `.grad` (ZeRO-2, ZeRO-3,
  BF16_Optimizer), a tensor hook sees each micro-batch's own gradient and, on collected steps only, the
  adapter sums them in float32 until the boundary (one float32 copy per monitored parameter, only while
  a collected step with gradient accumulation runs). The PipelineEngine (`layout.py`) has no accumulation
  boundary in backward: the local sum is taken at the start of its `ReduceGrads` instruction.
- Pipeline stages and expert parallelism split the model over ranks (`splits_model`): the global norm
  sums every rank's written rows. Experts are named by their global index. A layer tied across stages
  (`TiedLayerSpec`) is a copy over its stages' group: its rows are written by the group's first stage,
  once, as DeepSpeed's norm counts it; its grad_unreduced is each stage's own, read before the tied sum.

Where the optimizer-side tensors live: `reads.py`.
The `safe_get_full_*` functions all-reduce once per parameter and are never used here (tests only).
DeepSpeed is imported only once the user has imported it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainermon.collect.records import StepScalars
from trainermon.names import clean_name

from ..base import Adapter, AdapterContext, GradTaps, MonitoredParam
from ..common import Restore, guarded
from . import layout
from .engine import classify_optimizer, engine_scales_loss, find_engine, is_deepspeed_object
from .growth import Growth
from .reads import DeepSpeedReads

logger = logging.getLogger("trainermon")


class DeepSpeedAdapter(DeepSpeedReads, Adapter):
    name = "deepspeed"

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer: Any, context: AdapterContext) -> None:
        engine = find_engine(chunks, optimizer)
        if engine is None:
            raise TypeError("trainermon: no DeepSpeed engine found for this model and optimizer")
        if len(chunks) != 1:
            raise TypeError("trainermon: the DeepSpeed adapter takes one model (the engine or engine.module)")
        self.engine = engine
        ds_optimizer = engine.optimizer
        # the chunk as given (the engine or engine.module): `selection.wrapper_paths` then reads msprobe's
        # `module.`-prefixed targets (it names the engine's parameters) without the engine's path
        super().__init__(chunks, ds_optimizer, context)
        dp_group = context.dp_group
        self.kind = classify_optimizer(ds_optimizer)
        self._dp_group = getattr(engine, "seq_data_parallel_group", None) or getattr(
            engine, "data_parallel_group", None
        )
        if dp_group is not None and dp_group is not self._dp_group:
            logger.info(
                "trainermon: dp_group is ignored with DeepSpeed; the engine's data-parallel group is used"
            )
        self._params: list[MonitoredParam] | None = None
        self._fp32_master: dict[int, torch.Tensor] = {}  # fp16_wrapper: id(lp param) -> fp32 master
        self._zero12_group: dict[int, int] = {}  # zero12: id(lp param) -> param group index
        self._said_no_grads = False
        self._pipe = layout.is_pipeline(engine)
        self._renames = layout.expert_renames(engine.module)
        self._splits = layout.num_stages(engine) > 1 or layout.expert_parallel_size(engine.module) > 1
        self._tied = layout.tied_groups(engine)  # id(param) -> its tied layer's stages (a copy over them)
        self._index_maps()
        self._acc: dict[int, torch.Tensor] = {}  # float32 sums of earlier micro-batches (collected steps)
        self._grad_scale: float | None = None
        self._scales_loss: bool | None = None  # the engine's backward scales the loss (probed once)
        self._growth = Growth(self) if self.kind.name == "torch" else None
        steps = int(engine.gradient_accumulation_steps())
        if context.grad_acc_steps not in (1, steps):
            logger.warning(
                "trainermon: grad_acc_steps=%d differs from the DeepSpeed engine's %d; using the engine's",
                context.grad_acc_steps,
                steps,
            )
        context.grad_acc_steps = steps
        # ZeRO-3's forward hooks return `PreBackwardFunctionForModule.apply(output)`, a new tensor
        self.activation_hooks_first = self.kind.name == "zero3"

    def leaf_output_view(self, param: torch.Tensor) -> torch.Tensor:
        view = param.view_as(param)
        if self.activation_hooks_first and hasattr(param, "ds_id"):
            # ZeRO-3's post-forward hook, which now runs after ours, registers a returned parameter as
            # the module's external parameter; it knows a view of one by DeepSpeed's alias attribute
            view.ds_param_alias = param
        return view

    def msprobe_unreduced_kind(self, per_micro_batch: bool) -> str:
        # msprobe patches the reduction of DeepSpeedZeroOptimizer (ZeRO-1/2) only; ZeRO-0 (also with
        # BF16_Optimizer) and ZeRO-3 fall back to its hooks on the gradient accumulation
        zero12 = hasattr(self.engine.optimizer, "bit16_groups")
        return "pre_grad" if zero12 and not per_micro_batch else "acc_grad"

    @classmethod
    def owns_optimizer(cls, optimizer: Any) -> bool:
        return is_deepspeed_object(optimizer)

    @classmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        return find_engine(chunks, optimizer) is not None

    # ---- structure -----------------------------------------------------------------------------
    def roots(self) -> list[torch.nn.Module]:
        return [self.engine.module]

    def global_name(self, vpp_stage: int, name: str) -> str:
        return layout.rename(name, self._renames)

    def coordinates(self) -> dict[str, list[int]]:
        return layout.coordinates(self.engine, self._dp_group)

    @property
    def splits_model(self) -> bool:
        return self._splits

    def parameters(self) -> list[MonitoredParam]:
        if self._params is None:
            out: list[MonitoredParam] = []
            for name, p in self.engine.module.named_parameters():
                if p.requires_grad:
                    out.append(MonitoredParam(len(out), 0, layout.rename(clean_name(name), self._renames), p))
            self._params = out
            if self._growth is not None:
                self._growth.mark_known()
        return self._params

    def new_parameters(self) -> list[MonitoredParam]:
        """ZeRO-0 with a torch optimizer: parameters unfrozen since (DeepSpeed's other optimizers keep
        only the parameters trainable at setup). Costs on collected steps only: a count of flags."""
        return [] if self._growth is None else self._growth.new_parameters()

    def _index_maps(self) -> None:
        opt = self.optimizer
        if self.kind.name == "fp16_wrapper":
            for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups):
                for lp, hp in zip(lp_group, hp_group):
                    self._fp32_master[id(lp)] = hp
        elif self.kind.name == "zero12":
            groups = opt.bit16_groups if hasattr(opt, "bit16_groups") else opt.bf16_groups
            for g, group in enumerate(groups):
                for lp in group:
                    self._zero12_group[id(lp)] = g

    # ---- the step ------------------------------------------------------------------------------
    def attach_step(self, events: Any) -> list[Any]:
        engine = self.engine
        original = engine._take_model_step  # bound method of the class
        adapter = self

        def take_model_step(*args: Any, **kwargs: Any) -> Any:
            scale = adapter._loss_scale()  # the scale this step's gradients carry (an overflow changes it)
            events.pre()
            skipped_before = engine.skipped_steps
            out = original(*args, **kwargs)
            skipped = engine.skipped_steps > skipped_before
            events.post(StepScalars(loss_scale=scale, update_skipped=skipped))
            return out

        object.__setattr__(engine, "_take_model_step", take_model_step)
        return [Restore(engine, "_take_model_step", take_model_step)]

    def _loss_scale(self) -> float | None:
        if self.kind.name == "torch":
            return None
        try:
            # BF16_Optimizer never scales the loss and has no such attribute: its scale is 1.
            return float(getattr(self.optimizer, "loss_scale", 1.0))
        except Exception:  # noqa: BLE001 - a loss scale that cannot be read is not recorded
            return None

    def _applied_scale(self) -> float | None:
        """The loss scale the step's gradients carry: the optimizer's, where the engine's backward applied
        it, else None. Probed once (`engine_scales_loss`) at the first collected read with a scale != 1."""
        scale = self._loss_scale()
        if scale is None or scale == 1.0:
            return scale
        if self._scales_loss is None:
            self._scales_loss = engine_scales_loss(self.engine)
        return scale if self._scales_loss else None

    def new_step(self) -> None:
        self._acc.clear()

    def close(self) -> None:
        self._acc.clear()
        if self._growth is not None:
            self._growth.remove_taps()

    # ---- pre-reduce gradients ------------------------------------------------------------------
    def install_grad_taps(self, taps: GradTaps) -> list[Any]:
        handles: list[Any] = []
        if self._pipe:  # summed in backward where .grad does not keep the sum, reported at ReduceGrads
            if not self.kind.grad_keeps_sum:
                handles += [
                    mp.param.register_hook(self._summing_hook(mp.index, taps)) for mp in self.parameters()
                ]
            tap = layout.unreduced_at_reduce(self.parameters(), self.kind.grad_keeps_sum, self._acc, taps)
            guard = guarded(self.context.faults, "DeepSpeed pipeline gradient tap", tap)
            return [*handles, layout.ReduceTap(self.engine, guard)]
        if self._growth is not None:
            self._growth.taps = taps  # parameters unfrozen later get theirs when found
        return self._tap_params(self.parameters(), taps)

    def _tap_params(self, params: Sequence[MonitoredParam], taps: GradTaps) -> list[Any]:
        handles: list[Any] = []
        accumulate = self.kind.grad_keeps_sum is False and self.engine.gradient_accumulation_steps() > 1
        for mp in params:
            if accumulate:
                handles.append(mp.param.register_hook(self._summing_hook(mp.index, taps)))
            else:
                handles.append(
                    mp.param.register_post_accumulate_grad_hook(self._boundary_hook(mp.index, taps))
                )
        return handles

    @property
    def taps_report_unreduced(self) -> bool:
        return True

    def _boundary_hook(self, index: int, taps: GradTaps) -> Callable[[torch.Tensor], None]:
        engine = self.engine

        def hook(param: torch.Tensor) -> None:
            # .grad already holds this step's local sum; DeepSpeed reduces it after this backward.
            if taps.active and param.grad is not None and engine.is_gradient_accumulation_boundary():
                taps.on_unreduced([index], [param.grad])

        return guarded(self.context.faults, "DeepSpeed gradient tap", hook)

    def _summing_hook(self, index: int, taps: GradTaps) -> Callable[[torch.Tensor], None]:
        engine = self.engine
        acc = self._acc

        def hook(grad: torch.Tensor) -> None:
            # This micro-batch's own gradient; DeepSpeed reduces and frees it before the next one.
            if not taps.active or grad is None:
                return
            try:
                earlier = acc.get(index)
                if engine.is_gradient_accumulation_boundary():
                    total = grad if earlier is None else earlier.add_(grad)
                    acc.pop(index, None)
                    taps.on_unreduced([index], [total])
                elif earlier is None:
                    acc[index] = grad.detach().to(torch.float32, copy=True)
                else:
                    earlier.add_(grad)
            except Exception as exc:  # noqa: BLE001 - never raise into the backward pass
                acc.pop(index, None)
                self.context.faults.record("DeepSpeed gradient tap", exc)

        return hook
