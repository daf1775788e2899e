"""Train a small transformer-like model with FSDP and trainermon, on 2 CPU ranks (gloo).

    python examples/fsdp_train.py                    # spawns 2 ranks, FSDP1 then FSDP2, 5 steps each
    torchrun --nproc-per-node 2 examples/fsdp_train.py --fsdp 2 --steps 20 --out monitor_output

The monitor is attached with two lines after the model and optimizer exist; switching from msprobe is
the import. Each FSDP flavour writes CSV under `{out}/fsdp1` or `{out}/fsdp2`, one directory per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainermon import TrainerMon

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
        # Logits as (tokens, vocab): a 3-D Linear output is a view, which FSDP2 warns about.
        return self.output(h.flatten(0, 1))


def wrap(model: TinyLM, flavour: int) -> nn.Module:
    if flavour == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Layer}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(flavour: int, steps: int, out_dir: str, config_path: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = wrap(TinyLM(), flavour)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = TrainerMon(config_path)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)

    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        tokens = torch.randint(0, 64, (4, 16), generator=gen)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()  # the monitor's optimizer hooks collect the step here
        optimizer.zero_grad()
        if rank == 0:
            print(f"fsdp{flavour} step {step} loss {loss.item():.4f}", flush=True)
    monitor.flush()
    if rank == 0 and monitor.last_batch is not None:
        print(f"fsdp{flavour} global grad norm {monitor.last_batch.derived.global_grad_norm:.6f}", flush=True)
    monitor.close()


def run(args: argparse.Namespace) -> None:
    out = Path(args.out).resolve()
    config_path = args.config
    if config_path is None:
        config_path = str(out / "monitor_config.json")
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            Path(config_path).write_text(json.dumps(CONFIG, indent=2))
        dist.barrier()
    for flavour in (1, 2) if args.fsdp == "both" else (int(args.fsdp),):
        train(flavour, args.steps, str(out / f"fsdp{flavour}"), config_path)


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fsdp", choices=("1", "2", "both"), default="both")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("MONITOR_OUTPUT_DIR", "monitor_output"))
    parser.add_argument("--config", default=None, help="a monitor config (default: the one in this file)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            run(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
