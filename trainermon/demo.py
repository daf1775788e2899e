"""`trainermon demo`: a small GPT-like model trained on CPU with every family monitored.

Synthetic data (a noisy copy task), so it runs anywhere in a few seconds and needs no download.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import sys
import tempfile
import time

import torch
from torch import nn

DEMO_CONFIG = {
    "targets": {},
    "xy_distribution": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": ["norm", "min", "max", "mean", "nans", "infs"],
    "format": "csv",
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int = 512, d: int = 128, layers: int = 4, heads: int = 4, seq: int = 64
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.zeros(seq, d))
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        # Boolean causal mask (True = may not attend): not a floating-point activation, so no row
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        mask = self.mask[: tokens.shape[1], : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, mask)
        return self.output(self.final_norm(x))


def synthetic_batch(
    gen: torch.Generator, batch: int, seq: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _progress(i: int, total: int, loss: float, started: float) -> None:
    width = 30
    done = int(width * i / total)
    rate = i / max(time.perf_counter() - started, 1e-9)
    sys.stderr.write(
        f"\r  [{'#' * done}{'.' * (width - done)}] step {i}/{total}  loss {loss:.4f}  {rate:.1f} it/s"
    )
    sys.stderr.flush()
    if i == total:
        sys.stderr.write("\n")


def summarize(run_dir: str, top: int = 5) -> list[str]:
    """Short per-family summary read back from the CSV output: the layers with the largest norm."""
    lines = []
    for family in ("grad_reduced", "exp_avg", "param_updated", "actv"):
        # {family}_{first}-{last}.csv: `exp_avg_*` alone would also match exp_avg_sq's files
        files = sorted(glob.glob(os.path.join(run_dir, f"{family}_[0-9]*-[0-9]*.csv")))
        if not files:
            continue
        last: dict[str, float] = {}
        last_step = -1
        for path in files:
            with open(path, newline="") as fh:
                for row in csv.DictReader(fh):
                    step = int(row["step"])
                    if step > last_step:
                        last_step, last = step, {}
                    if step == last_step:
                        last[row["name"]] = float(row["norm"])
        ranked = sorted(last.items(), key=lambda kv: -kv[1] if not math.isnan(kv[1]) else 0)[:top]
        lines.append(f"  {family} (step {last_step}), largest norms:")
        lines += [f"    {norm:12.6g}  {name}" for name, norm in ranked]
    return lines


def run_demo(steps: int = 30, grad_acc: int = 2, output_dir: str | None = None, quiet: bool = False) -> str:
    """Train TinyGPT for `steps` optimizer steps with monitoring on; return this run's output directory."""
    from trainermon import TrainerMon

    if output_dir is not None:
        os.environ["MONITOR_OUTPUT_DIR"] = output_dir
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    vocab, seq = 512, 64
    model = TinyGPT(vocab=vocab, seq=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(DEMO_CONFIG, fh)
        config_path = fh.name
    try:
        monitor = TrainerMon(config_path)
        monitor.set_monitor(model, grad_acc_steps=grad_acc, optimizer=optimizer)
    finally:
        os.unlink(config_path)
    if not quiet:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"trainermon demo: TinyGPT ({n_params / 1e6:.2f}M parameters), "
            f"{steps} steps x {grad_acc} micro-batches"
        )
    started = time.perf_counter()
    loss = torch.tensor(0.0)
    for step in range(1, steps + 1):
        for _ in range(grad_acc):
            x, y = synthetic_batch(gen, 8, seq, vocab)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) / grad_acc
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not quiet:
            _progress(step, steps, loss.item() * grad_acc, started)
    monitor.close()
    if not quiet:
        print(f"\noutputs: {monitor.run_dir}")
        print(
            f"  {len(glob.glob(os.path.join(monitor.run_dir, '*.csv')))} CSV files; "
            f"monitor faults: {monitor.faults.total}; dropped rows: {monitor.dropped_rows}"
        )
        for line in summarize(monitor.run_dir):
            print(line)
    return monitor.run_dir
