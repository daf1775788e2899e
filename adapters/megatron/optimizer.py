"""Where Megatron-Core's optimizers keep each model parameter (checked against megatron-core 0.16.1).

FP32Optimizer: the model parameter itself (its `.grad` is `main_grad`). Float16OptimizerWithFloat16Params:
the full fp32 master copy. DistributedOptimizer: this rank's 1-D fp32 shard of the master, which covers
`_get_model_param_range_map(p)["param"]` of the flattened parameter (None where the rank owns no
element). With `num_distributed_optimizer_instances` > 1 the shards split over one instance's ranks only
(`data_parallel_group`), and the instances are copies of each other: Megatron all-reduces each rank's
gradient shard over the inter-instance group, and every instance steps the same state. A
ChainedOptimizer (dense and expert parameters) is searched leaf by leaf.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainermon.collect.placement import Placement

from .layout import MegatronLayout

logger = logging.getLogger("trainermon")


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside a (possibly nested) ChainedOptimizer, or the optimizer itself."""
    from megatron.core.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return [leaf for inner in optimizer.chained_optimizers for leaf in leaf_optimizers(inner)]
    return [optimizer]


def instance_copies(ddps: list[Any], optimizer: Any = None) -> dict[int, tuple[Any, ...]]:
    """By parameter id, the groups its optimizer-side values are copied over beyond its buffer's own data-
    parallel group: the inter-instance group of a partial distributed optimizer (DDP config
    `num_distributed_optimizer_instances` > 1), read from the bucket group that all-reduces its gradient
    shard over it. Empty with one instance. Once per monitor; nothing per step."""
    out: dict[int, tuple[Any, ...]] = {}
    for ddp in ddps:
        groups = list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))
        for bucket_group in groups:
            inter = getattr(bucket_group, "inter_distributed_optimizer_instance_group", None)
            if inter is None or inter.size() == 1:
                continue
            for bucket in bucket_group.buckets:
                for p in bucket.params_list:
                    out[id(p)] = (inter,)
    _optimizer_instance_copies(optimizer, out)
    return out


def _optimizer_instance_copies(optimizer: Any, out: dict[int, tuple[Any, ...]]) -> None:
    """Adds to `out` the parameters of a partial distributed optimizer that no given DDP wrapper covered
    (set_monitor got plain modules): parallel_state's inter-instance group, which Megatron builds once for
    dense and expert parameters alike. Without one, warns: each instance would write the same rows."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    leaves = leaf_optimizers(optimizer) if optimizer is not None else []
    missing = [
        p
        for leaf in leaves
        if isinstance(leaf, DistributedOptimizer)
        and getattr(getattr(leaf, "ddp_config", None), "num_distributed_optimizer_instances", 1) > 1
        for buffer in leaf.buffers
        for p in buffer.param_index_map
        if id(p) not in out
    ]
    if not missing:
        return
    from megatron.core import parallel_state as ps

    getter = getattr(ps, "get_inter_distributed_optimizer_instance_group", None)  # not in older releases
    inter = None if getter is None else getter(check_initialized=False)
    if inter is None or inter.size() == 1:
        logger.warning(
            "trainermon: a partial distributed optimizer (more than one instance) without Megatron's DDP "
            "wrappers or parallel_state's inter-instance group: %d parameters' optimizer-side rows may be "
            "written by each instance",
            len(missing),
        )
        return
    for p in missing:
        out[id(p)] = (inter,)


@dataclass(frozen=True)
class Slot:
    """Where the optimizer keeps one model parameter: its fp32 master (the full tensor, or this rank's
    shard, or None when this rank owns no element) and the torch optimizer whose state it keys."""

    master: torch.Tensor | None
    inner: Any  # torch.optim.Optimizer holding the state
    placement: Placement
    full_shape: tuple[int, ...]


def build_slots(
    optimizer: Any,
    layout: MegatronLayout,
    replica: Callable[[torch.Tensor], Placement],
    copies: Mapping[int, tuple[Any, ...]] | None = None,
) -> dict[int, Slot]:
    """Where the optimizer keeps each model parameter (by id), for every leaf optimizer. `copies`: by
    parameter id, the groups over which its distributed-optimizer shard is copied (the inter-instance
    group of a partial distributed optimizer). Once per monitor; nothing per step."""
    copies = copies or {}
    from megatron.core.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    slots: dict[int, Slot] = {}
    leaves = leaf_optimizers(optimizer) if optimizer is not None else []
    for leaf in leaves:
        if isinstance(leaf, torch.optim.Optimizer):  # a torch optimizer on a Megatron model, no wrapper
            for group in leaf.param_groups:
                for p in group["params"]:
                    slots[id(p)] = Slot(p, leaf, replica(p), layout.full_shape(p))
            continue
        inner = getattr(leaf, "optimizer", None)
        if getattr(leaf, "is_stub_optimizer", False) or inner is None:
            continue
        if isinstance(leaf, DistributedOptimizer):
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
                    where = layout.placement(
                        p, leaf.data_parallel_group, dp_sharded=True, copies=copies.get(id(p), ())
                    )
                    slots[id(p)] = Slot(owned.get(id(p)), inner, where, layout.full_shape(p))
        elif isinstance(leaf, Float16OptimizerWithFloat16Params):
            for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                for p, main in zip(model_group, main_group):
                    slots[id(p)] = Slot(main, inner, replica(p), layout.full_shape(p))
            for group in leaf.fp32_from_fp32_groups:
                for p in group:
                    slots[id(p)] = Slot(p, inner, replica(p), layout.full_shape(p))
        elif isinstance(leaf, FP32Optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    slots[id(p)] = Slot(p, inner, replica(p), layout.full_shape(p))
        else:
            logger.warning("trainermon: unknown Megatron optimizer %s; its tensors are skipped", type(leaf))
    return slots
