"""Shared test helpers: config files, a few monitored training steps, reading the CSV output back,
reference statistics."""

from __future__ import annotations

import csv
import glob
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn


def write_config(path: Path, **keys: Any) -> str:
    path.write_text(json.dumps(keys))
    return str(path)


def train_monitored(config_path: str, model: nn.Module, batch: Callable[[], torch.Tensor], steps: int = 2):
    """`model` trained `steps` SGD steps on `batch()` (loss: the output's sum of squares) under a
    TrainerMon built from `config_path`, then closed; returns the monitor (its run_dir, its faults)."""
    from trainermon import TrainerMon

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(config_path)
    monitor.set_monitor(model, optimizer=opt)
    for _ in range(steps):
        model(batch()).square().sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor


def read_family(run_dir: str, family: str) -> list[dict[str, str]]:
    """All rows of one family from a run directory, in file order."""
    rows: list[dict[str, str]] = []
    for f in sorted(glob.glob(os.path.join(run_dir, f"{family}_[0-9]*-[0-9]*.csv"))):
        with open(f, newline="") as fh:
            rows.extend(csv.DictReader(fh))
    return rows


def keyed(rows: list[dict[str, str]]) -> dict[tuple, dict[str, str]]:
    """Index rows by (name, step, micro_step or None)."""
    out = {}
    for r in rows:
        key = (r["name"], int(r["step"]), int(r["micro_step"]) if "micro_step" in r else None)
        assert key not in out, f"duplicate row {key}"
        out[key] = r
    return out


def compiled_grads(eager: dict, outside: Callable[[tuple], bool] = lambda key: False) -> dict:
    """The actv_grad rows (keyed) a compiled run writes where the same run done eagerly wrote `eager`: all
    of them on a torch whose dynamo traces tensor hooks into graphs (2.12 and later); on an older one only
    those of modules whose hooks ran outside the graphs (`outside(key)`): compiled modules write none there,
    by design and said once (README, torch.compile; torch 2.11 on the GPU host of session 30)."""
    from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH

    return dict(eager) if HOOKS_IN_GRAPH else {key: row for key, row in eager.items() if outside(key)}


def ref_stats(t: torch.Tensor) -> dict[str, float]:
    """Independent reference: plain float64 torch on a clone, NaN/Inf excluded as the monitor documents."""
    x = t.detach().to(torch.float64).flatten()
    finite = x[torch.isfinite(x)]
    return {
        "norm": float(finite.norm()) if finite.numel() else 0.0,
        "mean": float(finite.mean()) if finite.numel() else float("nan"),
        "min": float(finite.min()) if finite.numel() else float("nan"),
        "max": float(finite.max()) if finite.numel() else float("nan"),
        "nans": float(torch.isnan(x).sum()),
        "infs": float(torch.isinf(x).sum()),
    }


def assert_row_matches(
    row: dict[str, str], ref: dict[str, float], ops: tuple[str, ...], rtol: float = 1e-5
) -> None:
    numel = 1
    for d in json.loads(row["shape"]):
        numel *= d
    rms = ref["norm"] / max(numel, 1) ** 0.5
    for op in ops:
        got = float(row[op])
        want = ref[op]
        tol = rtol * abs(want) + 1e-9
        if op == "mean":
            # A mean near zero is a difference of large sums: float32 accumulation bounds its error
            # relative to the tensor's scale (rms), not to the tiny result.
            tol += 1e-6 * rms
        assert abs(got - want) <= tol, f"{row['name']} step {row['step']} {op}: got {got}, want {want}"


class LayeredNet(nn.Module):
    """A small model whose parameter names carry layer indices (layers.0, layers.1, head)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def compare_rows(
    tag: str,
    rows: dict,
    want: dict,
    problems: list[str],
    ops: tuple[str, ...] = ("norm", "mean", "min", "max"),
) -> None:
    """CSV rows (key -> row) against reference tensors (key -> tensor): the same keys, and each of `ops`
    within 1e-5 relative (+1e-9); each difference (the first op per key) is appended to `problems`."""
    if set(rows) != set(want):
        problems.append(f"{tag}: rows differ {sorted(set(rows) ^ set(want))[:4]}")
    for key in sorted(set(rows) & set(want)):
        ref = ref_stats(want[key])
        for op in ops:
            got, w = float(rows[key][op]), ref[op]
            if abs(got - w) > 1e-5 * abs(w) + 1e-9:
                problems.append(f"{tag} {key} {op}: got {got}, want {w}")
                break


def spy_reduced_grads(engine: Any, names: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DeepSpeed engine's full reduced gradients (float64 copies, by name), refreshed at each update
    just before it is applied (`engine._take_model_step` wrapped on the instance)."""
    from deepspeed.utils import safe_get_full_grad

    reduced: dict[str, torch.Tensor] = {}
    take_step = engine._take_model_step

    def spy(*args: Any, **kwargs: Any) -> Any:
        reduced.update({n: safe_get_full_grad(p).detach().double().clone() for n, p in names.items()})
        return take_step(*args, **kwargs)

    object.__setattr__(engine, "_take_model_step", spy)
    return reduced
