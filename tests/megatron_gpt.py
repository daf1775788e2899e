"""TEST-ONLY: a tiny real Megatron-Core GPTModel under a parallel layout, trained with Megatron's own
schedule (`get_forward_backward_func()`), on gloo ranks on the CPU (through `megatron_cpu_shim`).

Used inside spawned rank processes (`tests.distributed.run_ranks`):

    layout = Layout(pp=2, dist_opt=True)
    model, optimizer = setup(layout)                 # parallel state, chunks, Megatron DDP and optimizer
    for step in range(3):
        loss, grad_norm = train_step(model, optimizer, layout, step)

The model: 4 layers, hidden 32, 4 heads, vocabulary 64, sequence 16, local layer spec (no Transformer
Engine), `use_cpu_initialization`, `gradient_accumulation_fusion=False`; 2 micro-batches of 2 sequences
per step; the data depend on the step and the data-parallel rank only, so every layout of the same seed
sees the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

SEQ, VOCAB, MBS, MICRO = 16, 64, 2, 2
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
    deallocate: bool = True  # deallocate_pipeline_outputs, as Megatron-LM's training loop sets it
    extra: dict = field(default_factory=dict)  # more TransformerConfig keys


def init_parallel(layout: Layout) -> None:
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            expert_model_parallel_size=layout.ep,
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
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
        )
    keys.update(layout.extra)
    return TransformerConfig(**keys)


def build_chunks(layout: Layout) -> list[Any]:
    """One GPTModel per virtual-pipeline chunk of this rank's stage (pre/post process where Megatron puts
    them), unwrapped."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(layout)
    spec = get_gpt_layer_local_spec(num_experts=layout.experts, moe_grouped_gemm=False)
    chunks = []
    for vp in range(layout.vpp or 1):
        vp_stage = vp if layout.vpp else None
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
        clip_grad=1.0,
    )
    return model, get_megatron_optimizer(opt_config, model)


def setup(layout: Layout) -> tuple[list[Any], Any]:
    init_parallel(layout)
    torch.manual_seed(0)
    return wrap(build_chunks(layout), layout)


def micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """This step's micro-batches for this rank's data-parallel replica (same on its TP/PP/EP peers)."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    out = []
    for _ in range(MICRO):
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
    """One step with Megatron's schedule: zero, forward/backward over MICRO micro-batches, finalize, step.
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
        num_microbatches=MICRO,
        seq_length=SEQ,
        micro_batch_size=MBS,
        decoder_seq_length=SEQ,
        forward_only=False,
    )
    _, grad_norm, _ = optimizer.step()
    loss = float(torch.stack([d["loss"] for d in losses]).mean()) if losses else None
    return loss, float(grad_norm)
