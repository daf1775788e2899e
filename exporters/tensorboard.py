"""TensorBoard event files with msprobe's tags (`"format": "tensorboard"`), so that TensorBoard workflows
and dashboards built on msprobe's output keep working.

One `SummaryWriter` per rank directory (the run directory, as msprobe), written on the background worker.
Tags, as msprobe writes them: `{vpp_stage}:{name}[:{micro_step}]/rank{R}/{kind}_{statistic}` with kind
`acc_grad` or `pre_grad` (grad_unreduced, as msprobe names it for the framework:
`Adapter.msprobe_unreduced_kind`), `post_grad` (grad_reduced), `param_origin`, `param_updated`,
`exp_avg`, `exp_avg_sq`, `actv`, `actv_grad`; e.g. `0:layers.0.weight/rank0/post_grad_norm`. trainermon's own
step values are their own scalars: `trainermon/global_grad_norm`, `trainermon/loss_scale`. Needs the
`tensorboard` package (`pip install 'trainermon[tensorboard]'`); without it the sink does not open, with
one error, and the other sinks go on.
"""

from __future__ import annotations

import math

from trainermon.collect.family_columns import FAMILY_COLUMNS
from trainermon.collect.records import StatBatch
from trainermon.names import msprobe_tag
from trainermon.stats.table import VALUE_STATS

from .base import Exporter, RunInfo

_FAMILY_FLOATS = {
    f: [n for n, kind in cols if kind in ("float", "int")] for f, cols in FAMILY_COLUMNS.items()
}


class TensorBoardExporter(Exporter):
    def open(self, run: RunInfo) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError(
                "format 'tensorboard' needs the tensorboard package: pip install 'trainermon[tensorboard]'"
            ) from exc
        self.rank = run.rank
        self.unreduced = run.grad_unreduced_kind
        self.ops = [op for op in run.config.ops if op in VALUE_STATS or op == "numel"]
        self.writer = SummaryWriter(log_dir=run.run_dir)
        self._prefixes: dict[tuple, str] = {}

    def write(self, batch: StatBatch) -> None:
        add, step = self.writer.add_scalar, batch.step
        columns = [(op, batch.values[op]) for op in self.ops if op in batch.values]
        for i, row in enumerate(batch.rows):
            key = (row.family, row.vpp_stage, row.name, row.micro_step)
            prefix = self._prefixes.get(key)
            if prefix is None:
                prefix = self._prefixes[key] = msprobe_tag(*key, self.rank, self.unreduced)
            for op, column in columns:
                add(f"{prefix}_{op}", float(column[i]), step)
            for extra in _FAMILY_FLOATS.get(row.family, ()):  # update: ratio; moe_load: load_cv, ...
                column = batch.values.get(extra)
                if column is not None:
                    add(f"{prefix}_{extra}", float(column[i]), step)
        derived = batch.derived
        if derived.global_grad_norm is not None and math.isfinite(derived.global_grad_norm):
            add("trainermon/global_grad_norm", derived.global_grad_norm, step)
        if derived.loss_scale is not None:
            add("trainermon/loss_scale", derived.loss_scale, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
