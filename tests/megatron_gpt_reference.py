"""TEST-ONLY references for tests/megatron_gpt.py: single-process names and full optimizer tensors."""

from __future__ import annotations

from typing import Any

import torch


def grouped_expert_split(chunk: Any, local_name: str, p: Any) -> tuple[int, int]:
    """(size, rank) of the expert-parallel split of a GroupedMLP weight (all local experts in one
    parameter, the same name on every expert-parallel rank); (1, 0) for any other parameter."""
    from megatron.core import parallel_state

    grouped = chunk.config.moe_grouped_gemm and local_name.endswith(("experts.weight1", "experts.weight2"))
    if not grouped or getattr(p, "allreduce", True):
        return 1, 0
    ps = parallel_state
    return ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()


def single_process_name(chunk: Any, vpp_stage: int, local_name: str) -> str:
    """The name a TP=1, PP=1, EP=1 model gives `local_name` of this rank's chunk, from Megatron's own
    offsets (`get_transformer_layer_offset`, the expert-parallel rank), not from the module attributes
    the monitor reads."""
    import re

    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(
        chunk.config, vp_stage=vpp_stage if chunk.config.virtual_pipeline_model_parallel_size else None
    )
    name = re.sub(r"\blayers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", local_name, count=1)
    if chunk.config.num_moe_experts:
        per_rank = chunk.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        first = parallel_state.get_expert_model_parallel_rank() * per_rank
        name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + first}.", name)
    return name


def _leaf_of(optimizer: Any, p: Any) -> tuple[Any, Any, Any]:
    """(leaf optimizer, master tensor or None, (start, end) of the master in the flattened param or None)."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    leaves = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for leaf in leaves:
        if isinstance(leaf, DistributedOptimizer):
            for models, shards in (
                (leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups),
                (leaf.model_fp32_groups, leaf.shard_fp32_groups),
            ):
                for mg, sg in zip(models, shards):
                    for q, shard in zip(mg, sg):
                        if q is p:
                            r = leaf._get_model_param_range_map(p)["param"]
                            return leaf, shard, (r.start, r.end)
            if any(p in b.param_index_map for b in leaf.buffers):
                return leaf, None, (0, 0)  # this rank owns no element of p
        elif hasattr(leaf, "fp32_from_float16_groups"):
            for mg, fg in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                for q, main in zip(mg, fg):
                    if q is p:
                        return leaf, main, None
            for g in leaf.fp32_from_fp32_groups:
                if any(q is p for q in g):
                    return leaf, p, None
        elif any(q is p for g in leaf.optimizer.param_groups for q in g["params"]):
            return leaf, p, None
    raise AssertionError("parameter not found in the optimizer")


def full_optimizer_tensors(
    model: list[Any], optimizer: Any, keys: tuple[str, ...] = ("grad", "exp_avg", "exp_avg_sq", "param")
) -> dict[str, dict[str, torch.Tensor]]:
    """{single-process name: {"grad", "exp_avg", "exp_avg_sq", "param"}} as full fp32 tensors, gathered by
    the test with all_gather_object: distributed-optimizer shards over the optimizer's data-parallel
    group (placed by their range in the flattened parameter), then tensor-parallel pieces along
    `partition_dim` over the (expert-)tensor-parallel group. Collective over the whole job: every rank
    must call it at the same point. Skips `shared` parameters (Megatron's norm skips them too). `keys`:
    a subset (("param",) before the first step, when the optimizer has no state yet)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out: dict[str, dict[str, torch.Tensor]] = {}
    for vpp_stage, chunk in enumerate(model):
        root = chunk.module.module if hasattr(chunk.module, "module") else chunk.module
        for local_name, p in root.named_parameters():
            leaf, master, span = _leaf_of(optimizer, p)
            state = leaf.optimizer.state.get(master, {}) if master is not None else {}
            grad = None if master is None else (master.grad if master.grad is not None else p.main_grad)
            values = {
                "grad": grad,
                "exp_avg": state.get("exp_avg"),
                "exp_avg_sq": state.get("exp_avg_sq"),
                "param": None if master is None else master.data,
            }
            values = {
                k: (None if v is None else v.detach().float().reshape(-1).clone())
                for k, v in values.items()
                if k in keys
            }
            if isinstance(leaf, DistributedOptimizer):
                pieces = [None] * leaf.data_parallel_group.size()
                dist.all_gather_object(pieces, (span, values), group=leaf.data_parallel_group)
                full = {}
                for key in values:
                    flat = torch.zeros(p.numel())
                    for (start, end), got in pieces:
                        if end > start:
                            flat[start:end] = got[key]
                    full[key] = flat
                values = full
            values = {k: v.reshape(p.shape) for k, v in values.items()}
            if getattr(p, "tensor_model_parallel", False):
                expert = not getattr(p, "allreduce", True)
                group = (
                    parallel_state.get_expert_tensor_parallel_group()
                    if expert
                    else parallel_state.get_tensor_model_parallel_group()
                )
                if group.size() > 1:
                    pieces = [None] * group.size()
                    dist.all_gather_object(pieces, values, group=group)
                    values = {k: torch.cat([v[k] for v in pieces], dim=p.partition_dim) for k in values}
            if grouped_expert_split(root, local_name, p)[0] > 1:
                group = parallel_state.get_expert_model_parallel_group()
                pieces = [None] * group.size()
                dist.all_gather_object(pieces, values, group=group)
                values = {k: torch.cat([v[k] for v in pieces], dim=p.partition_dim) for k in values}
            if not getattr(p, "shared", False):
                out[single_process_name(root, vpp_stage, local_name)] = values
    return out
