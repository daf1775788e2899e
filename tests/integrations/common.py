"""What the integration tests share: a tiny regression model in the shape the HF Trainer expects (a dict
with `loss`), its data, and reference statistics keyed like the monitor's rows."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import ref_stats

OPS = ("norm", "mean", "min", "max")
IN, OUT = 6, 2


class TinyRegressor(nn.Module):
    """Not a PreTrainedModel: its loss is a plain mean, so that no Trainer-side token averaging applies."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, OUT)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.head(self.body(x))
        loss = (out - labels).pow(2).mean() if labels is not None else None
        return {"loss": loss, "logits": out}


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, IN, generator=gen)
        self.y = torch.randn(n, OUT, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


def grad_refs(model: nn.Module, step: int, out: dict) -> None:
    """out[("grad_reduced", name, step)] = reference statistics of every parameter's current .grad."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[("grad_reduced", name, step)] = ref_stats(p.grad)


def moment_refs(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, out: dict) -> None:
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in optimizer.state.get(p, {}):
                out[(key, name, step)] = ref_stats(optimizer.state[p][key])
