"""Megatron-Core's parallel layout as the monitor needs it: which groups split or copy each parameter,
the parameter's full shape, and the names a single-process model gives layers and experts.

Facts relied on (megatron-core 0.16.1):
- A tensor-parallel parameter has `tensor_model_parallel=True` and `partition_dim`; its full shape is
  the local shape with `partition_dim` multiplied by the tensor-parallel size. Other parameters
  (layernorms, row-parallel biases, routers) are identical on every tensor-parallel rank; with sequence
  parallelism `finalize_model_grads` all-reduces their gradients over the tensor-parallel group first.
- Expert parameters have `allreduce=False`; they are split over the expert-tensor-parallel group and
  reduced over the expert-data-parallel group (their DDP buffers carry that group).
- `TransformerLayer.layer_number` is the 1-based global layer number (pipeline and virtual-pipeline
  offsets included); `MoELayer.local_expert_indices` are the global indices of this rank's experts,
  held by `experts.local_experts.{i}` (SequentialMLP), or by `experts.linear_fc1.weight{i}` (Transformer
  Engine's grouped experts, one parameter per local expert; named here by the global index).
- The legacy grouped experts (`GroupedMLP`, `moe_grouped_gemm` with `moe_use_legacy_grouped_gemm`) hold
  all local experts in one `weight1` [hidden, experts x ffn] and one `weight2` [experts x ffn, hidden]:
  the same name on every expert-parallel rank, each holding its own experts' columns (rows). Those are
  pieces of one full tensor, split along `partition_dim` over the expert-parallel group (outside) and
  the expert-tensor-parallel group (inside): `grouped`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from trainermon.collect.placement import Placement, Replicated, Sharded
from trainermon.names import rename_prefixes


@dataclass(frozen=True)
class Axis:
    """One parallel dimension: its group (None when of size 1), this rank's coordinate, its size."""

    group: Any = None
    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class MegatronLayout:
    tp: Axis = Axis()
    etp: Axis = Axis()  # expert tensor parallel
    ep: Axis = Axis()
    pp: Axis = Axis()
    dp: Axis = Axis()  # data parallel (with context parallel), for parameters without a DDP buffer
    vpp_size: int = 1
    grouped: frozenset[int] = frozenset()  # ids of GroupedMLP weights split over expert-parallel ranks

    @staticmethod
    def read() -> MegatronLayout:
        """The layout from Megatron's `parallel_state` (all of size 1 when it is not initialised)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return MegatronLayout()

        def axis(group: Any) -> Axis:
            if group is None:
                return Axis()
            size = group.size()
            return Axis(group if size > 1 else None, group.rank(), size)

        def optional(getter: str, **kwargs: Any) -> Any:
            try:
                return getattr(ps, getter)(check_initialized=False, **kwargs)
            except (AssertionError, AttributeError, TypeError):
                return None

        return MegatronLayout(
            tp=axis(ps.get_tensor_model_parallel_group()),
            etp=axis(optional("get_expert_tensor_parallel_group")),
            ep=axis(optional("get_expert_model_parallel_group")),
            pp=axis(ps.get_pipeline_model_parallel_group()),
            dp=axis(ps.get_data_parallel_group(with_context_parallel=True)),
            vpp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        )

    def coordinates(self) -> dict[str, list[int]]:
        axes = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "etp": self.etp}
        return {name: [axis.rank, axis.size] for name, axis in axes.items()}

    def activation_shards(self, module: torch.nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Which activations of a tensor-parallel linear layer are pieces on this rank: a column-parallel
        layer's output (and its bias output) is split along the last dimension unless it gathers it;
        a row-parallel layer's input is split along the last dimension. Under sequence parallelism the
        hidden states around them are split along the sequence (first) dimension."""
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        expert = getattr(module, "is_expert", False)
        axis = self.etp if expert else self.tp
        if axis.size == 1 or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            return (), ()
        split = f"[{'etp' if expert else 'tp'}={axis.rank}/{axis.size}]"
        sequence = f"Shard(0){split}" if getattr(module, "sequence_parallel", False) else ""
        if isinstance(module, ColumnParallelLinear):
            last = "" if getattr(module, "gather_output", False) else f"Shard(-1){split}"
            bias = "" if getattr(module, "gather_output", False) else f"Shard(0){split}"
            return (sequence,), (last, bias)
        return (f"Shard(-1){split}",), (sequence,)

    def attention_shards(self, roots: list[torch.nn.Module]) -> dict[int, tuple[tuple[str, ...], ...]]:
        """`activation_shards` of the modules inside tensor-parallel attention, by module id: they hold
        this rank's heads. Core attention takes q, k, v as [s, b, heads, d] (split along dim 2) and returns
        [s, b, heads * d] (the last); its softmax and dropout see [b, heads, s, s] (dim 1); per-head q/k
        norms see [s, b, heads, d]. Self- and cross-attention only: multi-latent attention's q/k norms
        see the compressed latents, which are not split by head."""
        from megatron.core.transformer.attention import CrossAttention, SelfAttention

        if self.tp.size == 1:
            return {}
        split = f"[tp={self.tp.rank}/{self.tp.size}]"
        heads, scores = f"Shard(2){split}", f"Shard(1){split}"
        out: dict[int, tuple[tuple[str, ...], ...]] = {}
        for root in roots:
            for attention in root.modules():
                if not isinstance(attention, (SelfAttention, CrossAttention)):
                    continue
                core = getattr(attention, "core_attention", None)
                if isinstance(core, torch.nn.Module):
                    out[id(core)] = ((heads, heads, heads), (f"Shard(-1){split}",))
                    for inner in ("scale_mask_softmax", "attention_dropout"):
                        if isinstance(getattr(core, inner, None), torch.nn.Module):
                            out[id(getattr(core, inner))] = ((scores,), (scores,))
                for norm in ("q_layernorm", "k_layernorm"):
                    if isinstance(getattr(attention, norm, None), torch.nn.Module):
                        out[id(getattr(attention, norm))] = ((heads,), (heads,))
        return out

    @property
    def splits_model(self) -> bool:
        return self.tp.size > 1 or self.pp.size > 1 or self.ep.size > 1 or self.etp.size > 1

    def tensor_axis(self, p: torch.Tensor) -> Axis:
        return self.etp if is_expert(p) else self.tp

    def with_grouped_experts(self, roots: list[torch.nn.Module]) -> MegatronLayout:
        """This layout knowing the GroupedMLP weights of `roots` that expert parallelism splits."""
        if self.ep.size == 1:
            return self
        grouped = set()
        for root in roots:
            for module in root.modules():
                experts = getattr(module, "experts", None)
                if not isinstance(getattr(module, "local_expert_indices", None), (list, tuple)):
                    continue
                if experts is None or hasattr(experts, "local_experts"):
                    continue
                for name in ("weight1", "weight2"):
                    p = getattr(experts, name, None)
                    if isinstance(p, torch.Tensor) and is_expert(p) and is_tp_sharded(p):
                        grouped.add(id(p))
        return replace(self, grouped=frozenset(grouped))

    def full_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        shape = list(p.shape)
        axis = self.tensor_axis(p)
        if is_tp_sharded(p) and axis.size > 1:
            shape[p.partition_dim] *= axis.size
        if id(p) in self.grouped:
            shape[p.partition_dim] *= self.ep.size
        return tuple(shape)

    def placement(
        self, p: torch.Tensor, dp_group: Any, dp_sharded: bool, copies: tuple[Any, ...] = ()
    ) -> Placement:
        """Where the optimizer-side value of `p` lives: split over the tensor-parallel group if `p` is a
        tensor-parallel parameter, else copied over it; split over `dp_group` under the distributed
        optimizer (`dp_sharded`), else copied over it; copied over each group of `copies` (the
        inter-instance group of a partial distributed optimizer, whose instances each hold everything)."""
        axis = self.tensor_axis(p)
        tp = () if axis.group is None else (axis.group,)
        if id(p) in self.grouped:  # other experts on each expert-parallel rank: pieces over it too
            tp = (*tp, self.ep.group)
        if is_tp_sharded(p) and tp:
            if dp_sharded:
                return Sharded(*tp, dp_group, replicated=copies)
            return Sharded(*tp, replicated=(dp_group, *copies))
        return (
            Sharded(dp_group, replicated=(*tp, *copies)) if dp_sharded else Replicated(dp_group, *tp, *copies)
        )

    def shard_label(self, p: torch.Tensor) -> str:
        """How a rank's own copy of `p` (its pre-reduce gradient) relates to the full parameter."""
        axis = self.tensor_axis(p)
        parts = []
        if is_tp_sharded(p) and axis.size > 1:
            name = "etp" if is_expert(p) else "tp"
            parts.append(f"Shard({p.partition_dim})[{name}={axis.rank}/{axis.size}]")
        if id(p) in self.grouped:
            parts.append(f"Shard({p.partition_dim})[ep={self.ep.rank}/{self.ep.size}]")
        return " ".join(parts)


def is_expert(p: torch.Tensor) -> bool:
    return not getattr(p, "allreduce", True)


def is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False)) and hasattr(p, "partition_dim")


_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)$")
_PER_EXPERT = re.compile(r"^(weight|bias)(\d+)$")  # Transformer Engine's grouped linears: one per expert


def global_renames(root: torch.nn.Module) -> dict[str, str]:
    """Module-name prefix -> its last segment in the single-process model: `layers.{i}` of a pipeline
    stage or virtual chunk -> `layers.{layer_number - 1}`, `local_experts.{i}` -> the global expert."""
    renames: dict[str, str] = {}
    for name, module in root.named_modules():
        number = getattr(module, "layer_number", None)
        if isinstance(number, int) and _LAYER.match(name):
            renames[name] = str(number - 1)
        experts = getattr(module, "local_expert_indices", None)
        if isinstance(experts, (list, tuple)):
            prefix = f"{name}.experts" if name else "experts"
            for i, global_index in enumerate(experts):
                renames[f"{prefix}.local_experts.{i}"] = str(global_index)
            inner = getattr(module, "experts", None)
            for fc in ("linear_fc1", "linear_fc2"):
                linear = getattr(inner, fc, None)
                if not isinstance(linear, torch.nn.Module):
                    continue
                for param_name, _ in linear.named_parameters(recurse=False):
                    found = _PER_EXPERT.match(param_name)
                    if found and int(found[2]) < len(experts):
                        renames[f"{prefix}.{fc}.{param_name}"] = f"{found[1]}{experts[int(found[2])]}"
    return {k: v for k, v in renames.items() if not k.endswith(f".{v}")}


def rename(name: str, renames: dict[str, str]) -> str:
    """Apply `global_renames` to a module or parameter name (each prefix matched against the local name)."""
    return rename_prefixes(name, renames)
