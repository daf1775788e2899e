"""Train a small transformer-like model with DeepSpeed ZeRO and trainermon, on 2 CPU ranks (gloo).

    python examples/deepspeed_train.py                       # spawns 2 ranks: ZeRO-2, bf16, 5 steps
    python examples/deepspeed_train.py --stage 3 --fp32 --steps 20 --out monitor_output
    deepspeed --num_gpus 2 examples/deepspeed_train.py --stage 1   # under a launcher (RANK etc. set)

The monitor is attached with two lines after `deepspeed.initialize`; switching from msprobe is the import.
Each rank writes CSV under `{out}/{time}-rank{R}-{id}/`. On a machine without an accelerator, run with
DS_ACCELERATOR=cpu (set here when no GPU is visible).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIG = {
    "targets": {},
    "xy_distribution": True,
    "forward_only": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": ["norm", "min", "max", "mean", "nans"],
    "ndigits": 8,
}


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn_proj = nn.Linear(dim, dim)
        self.mlp_up = nn.Linear(dim, 4 * dim)
        self.mlp_down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_proj(self.norm(x))
        return x + self.mlp_down(torch.relu(self.mlp_up(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(depth))
        self.output = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(h).flatten(0, 1)


def ds_config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_acc,
        "train_batch_size": args.micro_batch * args.grad_acc * world,
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": not args.fp32},
        "gradient_clipping": 1.0,
        # A plain torch AdamW: DeepSpeed's fused and CPU Adam compile C++ first, for minutes on a CPU.
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "steps_per_print": 10**6,
    }


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        # DeepSpeed's CPU back-end builds a shared-memory all-reduce op on first use (about a minute);
        # gloo works without it.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    from trainermon import TrainerMon

    deepspeed.init_distributed(dist_backend="gloo" if os.environ.get("DS_ACCELERATOR") == "cpu" else None)
    torch.manual_seed(0)
    model = TinyLM()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args, world)
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / f"monitor_config.rank{rank}.json"
    config_path.write_text(json.dumps(CONFIG))
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    monitor = TrainerMon(str(config_path))
    monitor.set_monitor(engine, optimizer=engine.optimizer)  # grad_acc_steps comes from the engine

    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        for _ in range(args.grad_acc):
            tokens = torch.randint(0, 64, (args.micro_batch, 8), generator=gen)
            logits = engine(tokens)
            loss = nn.functional.cross_entropy(logits.to(torch.float32), tokens.flatten())
            engine.backward(loss)
            engine.step()  # applies the update at the accumulation boundary only
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}, grad norm {engine.get_global_grad_norm()}")
    monitor.close()
    if rank == 0:
        print(f"monitor output: {monitor.run_dir}")


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    train(rank, world, args)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--fp32", action="store_true", help="train in float32 (default: bf16)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--grad-acc", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2, help="ranks to spawn when not under a launcher")
    parser.add_argument("--out", default=os.environ.get("MONITOR_OUTPUT_DIR", "monitor_output"))
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = parser.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" in os.environ:  # started by torchrun or the deepspeed launcher
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(args.ranks, port, args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
