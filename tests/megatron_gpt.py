"""TEST-ONLY: a tiny real Megatron-Core GPTModel under a parallel layout, trained with Megatron's own
schedule (`get_forward_backward_func()`), on gloo ranks on the CPU (through `megatron_cpu_shim`).

Used inside spawned rank processes (`tests.distributed.run_ranks`):

    layout = Layout(pp=2, dist_opt=True)
    model, optimizer = setup(layout)                 # parallel state, chunks, Megatron DDP and optimizer
    for step in range(3):
        loss, grad_norm = train_step(model, optimizer, layout, step)

The model: 4 layers, hidden 32, 4 heads, vocabulary 64, sequence 16, local layer spec (no Transformer
Engine), `gradient_accumulation_fusion=False`. Every layout trains the same model on the same data: each
parameter starts from values drawn from its single-process name (`deterministic_init`, this rank's
tensor-parallel piece of them), and each step's global batch is GLOBAL_MICRO micro-batches of 2
sequences, split over the data-parallel replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from tests.megatron_gpt_reference import full_optimizer_tensors as full_optimizer_tensors
from tests.megatron_gpt_reference import grouped_expert_split, single_process_name

SEQ, VOCAB, MBS = 16, 64, 2
#: Micro-batches per step over all data-parallel replicas: each replica runs GLOBAL_MICRO / dp of them, so
#: every layout of the same seed trains on the same global batch.
GLOBAL_MICRO = 4
LAYERS, HIDDEN, HEADS = 4, 32, 4


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    sp: bool = False  # sequence parallelism (needs tp > 1)
    dist_opt: bool = False
    bf16: bool = False
    overlap: bool = False  # overlap_grad_reduce
    experts: int | None = None  # MoE: number of experts (top-2 routing)
    grouped: bool = False  # MoE experts as one GroupedMLP (legacy grouped GEMM), not SequentialMLP
    deallocate: bool = True  # deallocate_pipeline_outputs, as Megatron-LM's training loop sets it
    clip: float = 1.0  # clip_grad (a huge value keeps the norm computed and the gradients untouched)
    # GroupedMLP's activation through Megatron's jit_fuser (torch.compile): ~8 s of inductor per process
    # on a CPU; False builds it uncompiled
    fused_activation: bool = True
    extra: dict = field(default_factory=dict)  # more TransformerConfig keys
    # num_distributed_optimizer_instances (partial distributed optimizer; needs dist_opt). Megatron opens a
    # CUDA stream for the inter-instance all-reduce: the caller stubs torch.cuda's streams on the CPU
    instances: int = 1


def init_parallel(layout: Layout) -> None:
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    if layout.experts:
        megatron_cpu_shim.install_moe()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            expert_model_parallel_size=layout.ep,
            num_distributed_optimizer_instances=layout.instances,
        )
    model_parallel_cuda_manual_seed(1234)


def transformer_config(layout: Layout) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if layout.bf16 else torch.float32
    keys: dict[str, Any] = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=2 * HIDDEN,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=layout.sp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=layout.bf16,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        deallocate_pipeline_outputs=layout.deallocate,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if layout.experts:
        keys.update(
            num_moe_experts=layout.experts,
            moe_router_topk=2,
            expert_model_parallel_size=layout.ep,
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
            # megatron-core 0.16.1's expert MLP adds its bias in place into a view returned by a custom
            # autograd Function, which autograd refuses; linear biases off keeps MoE runnable
            add_bias_linear=False,
        )
    if layout.grouped:
        keys.update(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)
    keys.update(layout.extra)
    return TransformerConfig(**keys)


def build_chunks(layout: Layout) -> list[Any]:
    """One GPTModel per virtual-pipeline chunk of this rank's stage (pre/post process where Megatron puts
    them), unwrapped."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(layout)
    spec = get_gpt_layer_local_spec(
        num_experts=layout.experts,
        moe_grouped_gemm=layout.grouped,
        moe_use_legacy_grouped_gemm=layout.grouped,
    )
    chunks = []
    for vp in range(layout.vpp or 1):
        vp_stage = vp if layout.vpp else None
        if layout.sp:
            spec = _sequence_parallel_block(spec, config, vp_stage)
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
            )
        )
    return chunks


class SequenceParallelNorm(torch.nn.LayerNorm):
    """TEST-ONLY: torch's LayerNorm marked the way Megatron's fused norms mark their parameters under
    sequence parallelism (`finalize_model_grads` then all-reduces their gradients over the tensor-parallel
    group). Megatron's own torch norm refuses sequence parallelism, and Apex / Transformer Engine, whose
    norms accept it, do not install on this CPU machine."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def _sequence_parallel_block(layer_spec: Any, config: Any, vp_stage: int | None) -> Any:
    """The block spec for this chunk with every layernorm replaced by `SequenceParallelNorm`."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if isinstance(layer_spec, TransformerBlockSubmodules):
        layer_spec = layer_spec.layer_specs[0]
    sub = dataclasses.replace(
        layer_spec.submodules, input_layernorm=SequenceParallelNorm, pre_mlp_layernorm=SequenceParallelNorm
    )
    layer = ModuleSpec(module=layer_spec.module, params=layer_spec.params, submodules=sub)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=SequenceParallelNorm)


def wrap(chunks: list[Any], layout: Layout) -> tuple[list[Any], Any]:
    """Megatron DDP around each chunk (Float16Module first for bf16) and `get_megatron_optimizer`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=layout.dist_opt,
        overlap_grad_reduce=layout.overlap,
        bucket_size=2000 if layout.overlap else None,
        num_distributed_optimizer_instances=layout.instances,
    )
    model = []
    for i, chunk in enumerate(chunks):
        inner = Float16Module(chunk.config, chunk) if layout.bf16 else chunk
        ddp = DistributedDataParallel(chunk.config, ddp_config, inner, disable_bucketing=(i > 0))
        ddp.broadcast_params()
        model.append(ddp)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        bf16=layout.bf16,
        use_distributed_optimizer=layout.dist_opt,
        clip_grad=layout.clip,
    )
    return model, get_megatron_optimizer(opt_config, model)


def setup(layout: Layout) -> tuple[list[Any], Any]:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():  # another layout ran before in this process
        parallel_state.destroy_model_parallel()
    init_parallel(layout)
    torch.manual_seed(0)
    if layout.grouped:
        _grouped_gemm_stand_in()
    if layout.fused_activation:
        chunks = build_chunks(layout)
    else:
        from megatron.core.transformer.moe import experts

        fuser, experts.jit_fuser = experts.jit_fuser, lambda fn: fn
        try:
            chunks = build_chunks(layout)
        finally:
            experts.jit_fuser = fuser
    deterministic_init(chunks)
    return wrap(chunks, layout)


def _grouped_gemm_stand_in() -> None:
    """STAND-IN for the `grouped_gemm` package (CUDA kernels, not installable on this CPU host), which
    Megatron's GroupedMLP calls for its matrix products: the same products, one expert at a time, in
    plain torch. Only the kernel is replaced; the module, its parameters and their names are Megatron's."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe import grouped_gemm_util

    def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> Any:
        pieces = torch.split(a, batch_sizes.tolist())
        return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(pieces, b)])

    grouped_gemm_util.ops = SimpleNamespace(gmm=gmm)
    grouped_gemm_util.grouped_gemm = SimpleNamespace(ops=grouped_gemm_util.ops)


def deterministic_init(chunks: list[Any]) -> None:
    """Every parameter from values drawn from its single-process name (norm weights 1, biases 0, the
    rest N(0, 0.02)): this rank's tensor-parallel piece of the full tensor. Megatron's own initialisation
    draws from one RNG stream per rank, so a pipeline stage would start from other values than the same
    layer of a single-stage model."""
    import zlib

    from megatron.core import parallel_state

    for vpp_stage, chunk in enumerate(chunks):
        for local_name, p in chunk.named_parameters():
            name = single_process_name(chunk, vpp_stage, local_name)
            full_shape = list(p.shape)
            ep_size, ep_rank = grouped_expert_split(chunk, local_name, p)
            split = getattr(p, "tensor_model_parallel", False)
            if split:
                expert = not getattr(p, "allreduce", True)
                tp_size = (
                    parallel_state.get_expert_tensor_parallel_world_size()
                    if expert
                    else parallel_state.get_tensor_model_parallel_world_size()
                )
                tp_rank = (
                    parallel_state.get_expert_tensor_parallel_rank()
                    if expert
                    else parallel_state.get_tensor_model_parallel_rank()
                )
                full_shape[p.partition_dim] *= tp_size * ep_size
            if name.endswith("bias"):
                full = torch.zeros(full_shape)
            elif "norm" in name:
                full = torch.ones(full_shape)
            else:
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                full = torch.randn(full_shape, generator=gen) * 0.02
            if split:  # expert-parallel ranks outside, (expert-)tensor-parallel ranks inside
                full = full.chunk(ep_size, dim=p.partition_dim)[ep_rank]
                full = full.chunk(tp_size, dim=p.partition_dim)[tp_rank]
            with torch.no_grad():
                p.copy_(full)


def micro_count() -> int:
    """Micro-batches per step on this rank's data-parallel replica."""
    from megatron.core import parallel_state

    return GLOBAL_MICRO // parallel_state.get_data_parallel_world_size()


def micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """This step's micro-batches for this rank's data-parallel replica (same on its TP/PP/EP peers): its
    slice of the step's global batch."""
    from megatron.core import parallel_state

    count = micro_count()
    first = parallel_state.get_data_parallel_rank() * count
    out = []
    for index in range(first, first + count):
        gen = torch.Generator().manual_seed(1000 * step + index)
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
        out.append(
            {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, -1),
                "attention_mask": torch.ones(SEQ, SEQ, dtype=torch.bool).tril().logical_not()[None, None],
            }
        )
    return out


def _loss(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = output.float().mean()
    return loss, {"loss": loss.detach()}


def _forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(_loss_func)


def _loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    return _loss(output)


def train_step(model: list[Any], optimizer: Any, layout: Layout, step: int) -> tuple[float | None, float]:
    """One step with Megatron's schedule: zero, forward/backward over this replica's micro-batches,
    finalize, step.
    Returns (the last stage's mean loss or None, the optimizer's grad norm)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    data = micro_batches(step)
    iterators = [iter(data) for _ in model] if len(model) > 1 else iter(data)
    for chunk in model:
        chunk.config.finalize_model_grads_func = finalize_model_grads
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators,
        model=model if len(model) > 1 else model[0],
        num_microbatches=micro_count(),
        seq_length=SEQ,
        micro_batch_size=MBS,
        decoder_seq_length=SEQ,
        forward_only=False,
    )
    _, grad_norm, _ = optimizer.step()
    loss = float(torch.stack([d["loss"] for d in losses]).mean()) if losses else None
    return loss, float(grad_norm)
