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
  (`TiedLayerSpec`) are `tied_modules.{key}...` on each stage that holds them. `module.tied_comms[key]`
  holds the layer's `group` (the stages holding it, at one data-parallel (and model-parallel) coordinate)
  and `weight_attr`, the tied attributes: only those are broadcast at start and have their gradients
  summed over the group, by the `ReduceTiedGrads` instruction that every schedule runs just before
  `ReduceGrads`. All parameters of the layer are marked `ds_pipe_replicated` except on the group's first
  rank, and DeepSpeed's gradient norm skips the marked ones: each tied parameter counts once.
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


def coordinates(engine: Any, dp_group: Any) -> dict[str, list[int]]:
    """This rank's [rank, size] along "pp" (the pipeline stage), "dp" (the engine's data-parallel group),
    "ep" (with expert parallelism) and "tp" (where the engine has a model-parallel unit: Megatron's, the
    pipeline grid's model dimension, AutoTP's groups)."""
    import torch.distributed as dist

    pipe = is_pipeline(engine)
    coords = {"pp": [int(engine.stage_id), num_stages(engine)] if pipe else [0, 1]}
    if dp_group is None and dist.is_initialized():
        coords["dp"] = [dist.get_rank(), dist.get_world_size()]
    else:
        coords["dp"] = list(_group_rank_size(dp_group))
    ep = [_group_rank_size(layer.ep_group) for _, layer in _moe_layers(engine.module)]
    if ep and max(size for _, size in ep) > 1:
        coords["ep"] = list(max(ep, key=lambda rank_size: rank_size[1]))
    mpu = getattr(engine, "mpu", None)
    if mpu is not None:
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank, bwc_tensor_model_parallel_world_size

        coords["tp"] = [
            int(bwc_tensor_model_parallel_rank(mpu)),
            int(bwc_tensor_model_parallel_world_size(mpu)),
        ]
    return coords


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


def tied_groups(engine: Any) -> dict[int, Any]:
    """id(parameter) -> the group of the pipeline stages holding its tied layer. The layer is a copy over
    that group: written once, by the group's first rank (the stage DeepSpeed's gradient norm counts)."""
    comms = getattr(engine.module, "tied_comms", None) if num_stages(engine) > 1 else None
    out: dict[int, Any] = {}
    untied: list[str] = []
    for key, comm in sorted((comms or {}).items()):
        tied = {str(a) for a in comm.get("weight_attr", ())}
        for name, p in comm["module"].named_parameters():
            out[id(p)] = comm["group"]
            if name not in tied and p.requires_grad:
                untied.append(f"tied_modules.{key}.{name}")
    if untied:
        logger.warning(
            "trainermon: %s belong to layers tied across pipeline stages but are not tied themselves "
            "(TiedLayerSpec's tied_weight_attr): each stage trains its own copy; only the first stage's is "
            "written (the one DeepSpeed's gradient norm counts)",
            ", ".join(untied),
        )
    return out


def unreduced_at_reduce(
    params: Any, keeps_sum: bool, acc: dict[int, torch.Tensor], taps: Any
) -> Callable[[], None]:
    """What runs before the step's first reduction (`ReduceTap`): reports each parameter's local sum over
    the micro-batches, `.grad` where it keeps the sum, else the float32 sum the adapter's tensor hooks kept
    in `acc`."""

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
    """Calls `before()` once per step, at the start of the PipelineEngine's `ReduceTiedGrads` instruction
    (before the tied layers' gradients are summed over their stages) or of `ReduceGrads` where the
    schedule has no `ReduceTiedGrads`, through an instance-level copy of `_INSTRUCTION_MAP`. `remove()`
    drops the copy."""

    def __init__(self, engine: Any, before: Callable[[], None]) -> None:
        from deepspeed.runtime.pipe import schedule

        self.engine = engine
        table = dict(type(engine)._INSTRUCTION_MAP)
        done = [False]  # ReduceTiedGrads ran this step

        def wrap(instruction: type, tied: bool) -> None:
            original = table[instruction]

            def run(self_: Any, *args: Any, **kwargs: Any) -> Any:
                if not done[0]:
                    before()
                done[0] = tied
                return original(self_, *args, **kwargs)

            table[instruction] = run

        wrap(schedule.ReduceGrads, False)
        wrap(schedule.ReduceTiedGrads, True)
        self.table = table
        engine.__dict__["_INSTRUCTION_MAP"] = table

    def remove(self) -> None:
        if self.engine.__dict__.get("_INSTRUCTION_MAP") is self.table:
            del self.engine.__dict__["_INSTRUCTION_MAP"]
