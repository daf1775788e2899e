"""The Parquet exporter's state does not grow with the parts it has written: a long job cuts a part every
`seconds_per_part` (or at every flush) for weeks. It kept every part's path in a list nothing read.

`steps_per_part: 1` here compresses a long run into a few dozen steps: the sizes of everything the
exporter holds (containers, counted to the bottom) after N collected steps equal those after 2N, while
the parts on disk, counted independently by walking the dataset, double.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tests.helpers import write_config
from trainermon import TrainerMon

N = 20


def _size(value: Any, seen: set[int]) -> int:
    """Entries of every container reachable from `value` (strings and other leaves count 0)."""
    if id(value) in seen or isinstance(value, (str, bytes)):
        return 0
    seen.add(id(value))
    if isinstance(value, dict):
        return len(value) + sum(_size(k, seen) + _size(v, seen) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return len(value) + sum(_size(v, seen) for v in value)
    return 0


def _retained(exporter: Any) -> dict[str, int]:
    return {name: _size(value, set()) for name, value in vars(exporter).items()}


def _parts(root: str) -> int:
    return sum(f.endswith(".parquet") for _, _, files in os.walk(root) for f in files)


def test_exporter_state_does_not_grow_with_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = write_config(
        tmp_path / "c.json",
        wg_distribution=True,
        ops=["norm"],
        format="parquet",
        parquet={"steps_per_part": 1},
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    exporter = next(e for e in monitor.loop.worker.exporters if type(e).__name__ == "ParquetExporter")
    seen = []
    for step in range(2 * N):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step + 1 in (N, 2 * N):
            monitor.flush()
            seen.append((_parts(exporter.root), _retained(exporter)))
    monitor.close()
    (parts_n, state_n), (parts_2n, state_2n) = seen
    assert parts_n >= N and parts_2n == 2 * parts_n, (parts_n, parts_2n)  # one part per step and family
    assert state_2n == state_n, {k: (state_n.get(k), v) for k, v in state_2n.items() if state_n.get(k) != v}
