"""DeepSpeed's pipeline stages (`deepspeed.pipe.PipelineModule` run by the PipelineEngine) and expert
parallelism (`deepspeed.moe.layer.MoE`), as the monitor needs them (checked on deepspeed 0.19.8).

Facts relied on:
- The PipelineEngine runs a schedule of instructions through the class dictionary `_INSTRUCTION_MAP`
  (instruction type -> plain function, bound to the engine per call), so a patch of the engine's method
  itself is never called; an instance-level copy of the dictionary is. Its `ReduceGrads` runs once per
  `train_batch`, on every stage, after all backward passes and before any reduction: there `.grad` holds
  the local sum of the micro-batch gradients (ZeRO-0 and ZeRO-1; ZeRO-2/3 are refused with pipelines).
  `is_gradient_accumulation_boundary()` is True only inside it, so hooks in backward never see one.
- `PipelineModule` names its layers by their global index (`{i}.weight`) on every stage; tied layers
  (`TiedLayerSpec`) are `tied_modules.{key}...` on each stage that holds them.
- `MoE.deepspeed_moe` (a `MOELayer`) holds `num_local_experts` experts as `experts.deepspeed_experts.{i}`
  and, once the engine is built, its expert-parallel group as `ep_group`: local expert i of expert-
  parallel rank r is global expert r * num_local_experts + i. Expert parameters carry `allreduce=False`
  and `group_name`; their gradients are reduced over that name's expert-data-parallel group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from trainermon.names import rename_prefixes

logger = logging.getLogger("trainermon")


def is_pipeline(engine: Any) -> bool:
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except Exception:  # noqa: BLE001 - no pipeline support in this DeepSpeed: not a pipeline engine
        return False
    return isinstance(engine, PipelineEngine)


def num_stages(engine: Any) -> int:
    return int(getattr(engine, "num_stages", 1) or 1) if is_pipeline(engine) else 1


def _moe_layers(root: torch.nn.Module) -> list[tuple[str, Any]]:
    """(module name, MOELayer) of every DeepSpeed MoE layer in `root`."""
    out = []
    for name, module in root.named_modules():
        experts = getattr(module, "experts", None)
        if hasattr(module, "ep_group") and hasattr(module, "num_local_experts") and experts is not None:
            if isinstance(getattr(experts, "deepspeed_experts", None), torch.nn.ModuleList):
                out.append((name, module))
    return out


def _group_rank_size(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def expert_parallel_size(root: torch.nn.Module) -> int:
    return max((_group_rank_size(layer.ep_group)[1] for _, layer in _moe_layers(root)), default=1)


def expert_renames(root: torch.nn.Module) -> dict[str, str]:
    """Module-name prefix -> its last segment in the single-process model: `...deepspeed_experts.{i}`
    -> the global expert index."""
    renames: dict[str, str] = {}
    for name, layer in _moe_layers(root):
        rank, _ = _group_rank_size(layer.ep_group)
        local = int(layer.num_local_experts)
        prefix = f"{name}.experts.deepspeed_experts" if name else "experts.deepspeed_experts"
        for i in range(local):
            if rank * local + i != i:
                renames[f"{prefix}.{i}"] = str(rank * local + i)
    return renames


def rename(name: str, renames: dict[str, str]) -> str:
    """Apply `expert_renames` to a module or parameter name."""
    return rename_prefixes(name, renames)


def expert_data_group(p: torch.Tensor) -> Any:
    """The group an expert parameter's gradient is reduced over (None: not an expert parameter)."""
    if getattr(p, "allreduce", True) or not hasattr(p, "group_name"):
        return None
    try:
        from deepspeed.utils import groups

        return groups._get_expert_data_parallel_group(p.group_name)
    except Exception:  # noqa: BLE001 - an unknown group: the engine's data-parallel group is used
        return None


def warn_tied(engine: Any) -> None:
    """Tied layers on several stages: each such stage writes them under the same name."""
    tied = getattr(engine.module, "tied_modules", None)
    if num_stages(engine) > 1 and tied is not None and len(tied) > 0:
        logger.warning(
            "trainermon: the pipeline ties layers across stages (%s): each stage holding them writes their "
            "rows under the same name, and the global gradient norm counts them once per such stage (it "
            "differs from DeepSpeed's)",
            ", ".join(sorted(tied.keys())),
        )


def unreduced_at_reduce(
    params: Any, keeps_sum: bool, acc: dict[int, torch.Tensor], taps: Any
) -> Callable[[], None]:
    """What runs at the start of ReduceGrads: reports each parameter's local sum over the micro-batches,
    `.grad` where it keeps the sum, else the float32 sum the adapter's tensor hooks kept in `acc`."""

    def before_reduce() -> None:
        if not taps.active:
            return
        if keeps_sum:
            got = [(mp.index, mp.param.grad) for mp in params if mp.param.grad is not None]
        else:
            got = [(mp.index, acc.pop(mp.index)) for mp in params if mp.index in acc]
        if got:
            taps.on_unreduced([i for i, _ in got], [g for _, g in got])

    return before_reduce


class ReduceTap:
    """Calls `before()` at the start of the PipelineEngine's `ReduceGrads` instruction, through an
    instance-level copy of `_INSTRUCTION_MAP`. `remove()` drops the copy."""

    def __init__(self, engine: Any, before: Callable[[], None]) -> None:
        from deepspeed.runtime.pipe import schedule

        self.engine = engine
        table = dict(type(engine)._INSTRUCTION_MAP)
        original = table[schedule.ReduceGrads]

        def reduce_grads(self_: Any, *args: Any, **kwargs: Any) -> Any:
            before()
            return original(self_, *args, **kwargs)

        table[schedule.ReduceGrads] = reduce_grads
        self.table = table
        engine.__dict__["_INSTRUCTION_MAP"] = table

    def remove(self) -> None:
        if self.engine.__dict__.get("_INSTRUCTION_MAP") is self.table:
            del self.engine.__dict__["_INSTRUCTION_MAP"]
