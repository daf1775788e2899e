"""A Megatron-style pretrain loop with trainermon: two lines after `setup_model_and_optimizer`.

    torchrun --nproc-per-node 8 examples/megatron_pretrain.py --steps 20 --out monitor_output   # GPUs
    torchrun --nproc-per-node 2 examples/megatron_pretrain.py --cpu                              # CPU, gloo

`--cpu` installs the test suite's CUDA shim (tests/megatron_cpu_shim.py) so that megatron-core's CUDA-only
code paths run on the CPU; it exists for the tests and demos, never for real training.

The model is a tiny GPTModel (local layer spec, bf16) under Megatron's DDP with the distributed
optimizer. Switching from msprobe is the import line; the two monitor lines are marked below.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from trainermon import TrainerMon

SEQ, VOCAB = 16, 64
ALL_FAMILIES = {
    "xy_distribution": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": ["norm", "min", "max", "mean", "nans"],
    "ndigits": 12,
}
GRADS_ONLY = {"wg_distribution": True, "ops": ["norm", "min", "max", "mean"], "ndigits": 8}


def model_provider() -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, bf16=True, params_dtype=torch.bfloat16
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )


def setup_model_and_optimizer() -> tuple[list[torch.nn.Module], Any]:
    """What Megatron's training.setup_model_and_optimizer returns: the model chunks and the optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    gpt = model_provider()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = [DistributedDataParallel(gpt.config, ddp_config, Float16Module(gpt.config, gpt))]
    for chunk in model:
        chunk.broadcast_params()
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True, clip_grad=1.0
    )
    return model, get_megatron_optimizer(opt_config, model)


def pretrain(out_dir: str, steps: int = 5, all_families: bool = True) -> dict[str, Any]:
    """Train on random tokens. Needs torch.distributed initialised; returns the monitor and, per step,
    (optimizer's grad norm, monitor's global grad norm)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    rank = dist.get_rank()
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    os.makedirs(out_dir, exist_ok=True)
    config_path = os.path.join(out_dir, f"monitor_config-rank{rank}.json")
    with open(config_path, "w") as fh:
        json.dump(ALL_FAMILIES if all_families else GRADS_ONLY, fh)

    model, optimizer = setup_model_and_optimizer()
    # ---- the two trainermon lines ---------------------------------------------------------------
    monitor = TrainerMon(config_path, params_have_main_grad=True)
    monitor.set_monitor(
        model,
        grad_acc_steps=1,
        optimizer=optimizer,
        dp_group=parallel_state.get_data_parallel_group(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
    )
    # ---------------------------------------------------------------------------------------------

    gen = torch.Generator().manual_seed(1000 + rank)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(4, -1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().logical_not()[None, None]
    norms = []
    for _ in range(steps):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen)
        loss = model[0](tokens[:, :-1], position_ids, causal, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        finalize_model_grads(model)
        _, grad_norm, _ = optimizer.step()
        monitor.flush()
        batch = monitor.last_batch
        norms.append((float(grad_norm), batch.derived.global_grad_norm if batch else None))
        if rank == 0:
            print(
                f"loss {float(loss):.4f} grad norm {float(grad_norm):.6f} monitor {norms[-1][1]}", flush=True
            )
    monitor.close()
    return {"monitor": monitor, "norms": norms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    default_out = os.path.join(os.environ.get("MONITOR_OUTPUT_DIR", "monitor_output"), "megatron")
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--cpu", action="store_true", help="gloo + the test-only CUDA shim")
    args = parser.parse_args()

    import torch.distributed as dist

    if args.cpu:
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from tests import megatron_cpu_shim

        megatron_cpu_shim.install()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if args.cpu else "nccl")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    try:
        pretrain(args.out, args.steps)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
