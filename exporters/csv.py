"""CSV exporter in msprobe's layout, so existing scripts keep working.

Files: `{run_dir}/{family}_{first}-{last}.csv`, where [first, last] is the step bucket of
`step_count_per_record` steps. Columns: `vpp_stage,name,step[,micro_step],{ops...},shape,dtype`
(micro_step for actv, actv_grad, and grad_unreduced with monitor_mbs_grad). Every step is written with
one write call and flushed, so a killed process leaves complete rows only.
"""

from __future__ import annotations

import csv
import io
import math
import os
from typing import TextIO

from trainermon.records import StatBatch

from .base import Exporter, RunInfo

_NUMERIC_OPS = ("norm", "min", "max", "mean", "zeros")
_COUNT_OPS = ("nans", "infs", "numel")


def format_value(value: float, ndigits: int) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    # ndigits significant digits (msprobe rounds to ndigits decimal places, which turns an Adam second
    # moment of 1e-9 into 0.0; significant digits keep small statistics readable in the same layout).
    return f"{float(value):.{ndigits}g}"


class CsvExporter(Exporter):
    def __init__(self) -> None:
        self._files: dict[str, tuple[int, TextIO]] = {}

    def open(self, run: RunInfo) -> None:
        self.run_dir = run.run_dir
        self.ops = run.config.ops
        self.ndigits = run.config.ndigits
        self.per_record = run.config.step_count_per_record
        os.makedirs(self.run_dir, exist_ok=True)

    def header(self, with_micro_step: bool) -> list[str]:
        head = ["vpp_stage", "name", "step"] + (["micro_step"] if with_micro_step else [])
        return head + list(self.ops)

    def write(self, batch: StatBatch) -> None:
        by_family: dict[str, list[int]] = {}
        for i, row in enumerate(batch.rows):
            by_family.setdefault(row.family, []).append(i)
        for family, indices in by_family.items():
            with_micro = any(batch.rows[i].micro_step is not None for i in indices)
            handle = self._file_for(family, batch.step, with_micro)
            buf = io.StringIO()
            writer = csv.writer(buf, lineterminator="\n")
            for i in indices:
                row = batch.rows[i]
                line: list[object] = [row.vpp_stage, row.name, batch.step]
                if with_micro:
                    line.append(row.micro_step if row.micro_step is not None else 0)
                for op in self.ops:
                    if op in _NUMERIC_OPS:
                        line.append(format_value(batch.values[op][i], self.ndigits))
                    elif op in _COUNT_OPS:
                        line.append(int(batch.values[op][i]))
                    elif op == "shape":
                        line.append(str(list(row.shape)))
                    elif op == "dtype":
                        line.append(str(row.dtype))
                writer.writerow(line)
            handle.write(buf.getvalue())
            handle.flush()

    def _file_for(self, family: str, step: int, with_micro: bool) -> TextIO:
        first = (step // self.per_record) * self.per_record
        current = self._files.get(family)
        if current is not None and current[0] == first:
            return current[1]
        if current is not None:
            current[1].close()
        path = os.path.join(self.run_dir, f"{family}_{first}-{first + self.per_record - 1}.csv")
        new = not os.path.exists(path)
        handle = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115 - kept open across steps
        if new:
            handle.write(",".join(self.header(with_micro)) + "\n")
            handle.flush()
        self._files[family] = (first, handle)
        return handle

    def flush(self) -> None:
        for _, handle in self._files.values():
            handle.flush()

    def close(self) -> None:
        for _, handle in self._files.values():
            handle.close()
        self._files.clear()
