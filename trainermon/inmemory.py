"""msprobe's in-memory metrics (`TrainerMon.generate_wgrad_metrics`, `generate_xy_metrics`): a finished
step's rows as `{tag: {statistic: 0-d tensor}}`, keyed by msprobe's tags without the statistic
(`0:layers.0.weight/rank0/post_grad`, `0:layers.0.output:0/rank0/actv`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainermon.collect.records import StatBatch
from trainermon.names import msprobe_tag
from trainermon.stats.table import VALUE_STATS


def metric_dict(
    batch: StatBatch | None, family: str, rank: int, ops: Sequence[str], unreduced: str = "pre_grad"
) -> dict[str, dict[str, Any]]:
    """The rows of `family` in `batch` (none: {}), each with the configured statistics it has as float64
    scalars on the CPU, and `shape` (a torch.Size) and `dtype` (a torch.dtype) when configured, as msprobe
    gives them. `unreduced`: the tag kind of grad_unreduced rows. One small tensor per value; no device
    work."""
    if batch is None:
        return {}
    wanted = [op for op in ops if op in VALUE_STATS or op == "numel"]
    columns = [(op, batch.values[op]) for op in wanted if op in batch.values]
    shape, dtype = "shape" in ops, "dtype" in ops
    out: dict[str, dict[str, Any]] = {}
    for i, row in enumerate(batch.rows):
        if row.family == family:
            tag = msprobe_tag(family, row.vpp_stage, row.name, row.micro_step, rank, unreduced)
            values: dict[str, Any] = {
                op: torch.tensor(float(column[i]), dtype=torch.float64) for op, column in columns
            }
            if shape:
                values["shape"] = torch.Size(row.shape)
            if dtype:
                values["dtype"] = row.dtype
            out[tag] = values
    return out
