"""The overhead benchmark's workloads: (a) a GPT-like model, (b) many narrow layers, (c) a many-expert MoE.

Each is a `Workload`: how to build the model, one fixed batch and the loss, so that every arm of a benchmark
trains the same problem (`benchmarks/overhead.py` and the scripts built on it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class NarrowLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(nn.functional.gelu(self.norm(x)))


class ManyTensorModel(nn.Module):
    """48 narrow residual layers: 194 small parameter tensors, where per-tensor cost dominates."""

    def __init__(self, d: int = 128, layers: int = 48) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NarrowLayer(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class MoELayer(nn.Module):
    """A top-2 mixture-of-experts block routed as in HF Mixtral: a router, then each expert on its tokens."""

    def __init__(self, d: int, experts: int, top_k: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weights, chosen = torch.topk(self.router(h).softmax(dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
        return x + out


class MoEModel(nn.Module):
    """(c): 8 MoE layers x 16 experts, small d: the most modules per parameter a user monitors."""

    def __init__(self, d: int = 64, layers: int = 8, experts: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(d, experts) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@dataclass(frozen=True)
class Workload:
    key: str  # "a", "b" or "c", as the issues name them
    title: str
    build: Callable[[], nn.Module]
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gpt_workload(
    d: int = 512, layers: int = 8, vocab: int = 8192, seq: int = 256, batch: int = 8
) -> Workload:
    from trainermon.demo import TinyGPT, synthetic_batch

    def build() -> nn.Module:
        return TinyGPT(vocab=vocab, d=d, layers=layers, heads=8, seq=seq)

    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return synthetic_batch(torch.Generator().manual_seed(1), batch, seq, vocab)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    title = f"GPT-like d={d} layers={layers} vocab={vocab} seq={seq} batch={batch}"
    return Workload("a", title, build, make_batch, loss)


def many_workload(d: int = 128, layers: int = 48, tokens: int = 512) -> Workload:
    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(tokens, d, generator=g), torch.randn(tokens, 1, generator=g)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target)

    title = f"many-tensor: {layers} narrow layers d={d}, {tokens} tokens"
    return Workload("b", title, lambda: ManyTensorModel(d, layers), make_batch, loss)


def moe_workload(d: int = 64, layers: int = 8, experts: int = 16, tokens: int = 512) -> Workload:
    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(tokens, d, generator=g), torch.randn(tokens, 1, generator=g)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target)

    title = f"MoE: {layers} layers x {experts} experts (top-2) d={d}, {tokens} tokens"
    return Workload("c", title, lambda: MoEModel(d, layers, experts), make_batch, loss)


def standard_workloads(quick: bool) -> dict[str, Workload]:
    if quick:  # the same two kinds of problem, small enough for a smoke run
        return {
            "a": gpt_workload(d=128, layers=2, vocab=1024, seq=64, batch=4),
            "b": many_workload(d=64, layers=48, tokens=128),
            "c": moe_workload(d=32, layers=2, experts=8, tokens=128),
        }
    return {"a": gpt_workload(), "b": many_workload(), "c": moe_workload()}
