"""TEST-ONLY: msprobe's documented usage on a small seeded GPT-like model, run with msprobe's TrainerMon or
trainermon's; only the import line differs. Run as a script: `python -m tests.msprobe_gpt TOOL OUT_DIR`."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": ["norm", "min", "max", "mean"],
    "format": "csv",
    "ndigits": 12,
}
STEPS, MICRO = 3, 2


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        # Three distinct tensors: with one tensor three times, nn.MultiheadAttention's packed path runs
        # in trainermon's process and not under msprobe's hooks (which break the identity), and the two
        # runs would train on slightly different numbers.
        a, _ = self.attn(h, h.clone(), h.clone(), need_weights=False)
        return x + self.fc(a)


class GPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def main(tool: str, out: str) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = out
    if tool == "msprobe":
        from msprobe.pytorch import TrainerMon, seed_all
    else:
        from trainermon import TrainerMon, seed_all
    seed_all(1234)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    os.makedirs(out, exist_ok=True)
    cfg = os.path.join(out, "monitor_config.json")
    with open(cfg, "w") as fh:
        json.dump(CONFIG, fh)
    monitor = TrainerMon(cfg, params_have_main_grad=False)
    # msprobe's documented call: set_monitor(model, optimizer, grad_acc_steps) (positional optimizer)
    monitor.set_monitor(model, optimizer, grad_acc_steps=MICRO)
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        for _ in range(MICRO):
            ids = torch.randint(0, 32, (2, 8), generator=gen)
            nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    if tool != "msprobe":
        monitor.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
