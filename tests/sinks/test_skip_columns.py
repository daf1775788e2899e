"""Whose skip a skipped step was, in the files: CSV `skipped` = 2 for the training loop's own skip (1: a loss
scaler's or the framework's, 0: the update ran, empty: not known), Parquet `skipped` plus `own_skip`
(null where `skipped` is). Written through the real exporters and read back with `trainermon.load` and
`trainermon convert`; Parquet files written before `own_skip` existed still load, reading it as null."""

from __future__ import annotations

import csv
import glob

import numpy as np
import pyarrow.parquet as pq
import torch

import trainermon
from trainermon import parse_config
from trainermon.collect.records import RowMeta, StatBatch, StepScalars
from trainermon.exporters import RunInfo
from trainermon.exporters.csv import CsvExporter
from trainermon.exporters.parquet import ParquetExporter

RUN_DIR = "Dec01_10-00-00-rank0-abcd"  # a run directory name `convert` recognises
#: step -> (update_skipped, own_skip): the loop's own skip, a loss scaler's skip, ran, not known
CASES = {0: (True, True), 1: (True, False), 2: (False, False), 3: (None, False)}
CSV_FLAGS = {0: "2", 1: "1", 2: "0", 3: ""}
SKIPPED = {0: True, 1: True, 2: False, 3: None}
OWN_SKIP = {0: True, 1: False, 2: False, 3: None}
NAMES = ("layers.0.weight", "layers.1.weight")


def _batch(step: int) -> StatBatch:
    rows = [RowMeta("grad_reduced", 0, name, None, (2, 2), torch.float32, 4) for name in NAMES]
    values = {"norm": np.full(len(rows), float(step) + 0.5), "nans": np.zeros(len(rows))}
    skipped, own = CASES[step]
    return StatBatch(step, rows, values, scalars=StepScalars(update_skipped=skipped, own_skip=own))


def _write(exporter, root) -> None:
    cfg = parse_config({"ops": ["norm", "nans"], "format": ["csv", "parquet"]})
    exporter.open(RunInfo(str(root / "out" / RUN_DIR), str(root / "out"), 0, 1, "abcd", cfg))
    for step in CASES:
        exporter.write(_batch(step))
    exporter.close()


def _flags(table, column: str) -> dict[int, set]:
    out: dict[int, set] = {}
    for row in table.select(["step", column]).to_pylist():
        out.setdefault(row["step"], set()).add(row[column])
    return out


def test_csv_tells_the_loops_own_skip_from_a_scalers_and_keeps_the_layout(tmp_path):
    _write(CsvExporter(), tmp_path)
    rows = []
    for path in glob.glob(str(tmp_path / "out" / RUN_DIR / "grad_reduced_*.csv")):
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            rows += list(reader)
        # msprobe's columns, then shard and skipped last: no new column for the own skip
        assert reader.fieldnames[:4] == ["vpp_stage", "name", "step", "norm"]
        assert reader.fieldnames[-2:] == ["shard", "skipped"] and "own_skip" not in reader.fieldnames
    got: dict[int, set] = {}
    for row in rows:
        got.setdefault(int(row["step"]), set()).add(row["skipped"])
    assert got == {step: {flag} for step, flag in CSV_FLAGS.items()}, got
    from trainermon.analysis import open_run  # the analysis reads the files as before

    source = open_run(str(tmp_path / "out"))
    norms = np.concatenate([b.stats["norm"][0] for b in source.iter_batches(stats=["norm"])])
    assert source.kind == "csv" and sorted(norms.tolist()) == sorted([s + 0.5 for s in CASES] * len(NAMES))
    # `trainermon convert` reads the CSV flags back into Parquet's two columns
    from trainermon.convert import convert

    convert(tmp_path / "out", tmp_path / "converted")
    table = trainermon.load(tmp_path / "converted", family="grad_reduced")
    assert _flags(table, "skipped") == {step: {v} for step, v in SKIPPED.items()}
    assert _flags(table, "own_skip") == {step: {v} for step, v in OWN_SKIP.items()}


def test_parquet_has_own_skip_beside_skipped(tmp_path):
    _write(ParquetExporter(), tmp_path)
    table = trainermon.load(tmp_path / "out", family="grad_reduced")
    assert table.schema.field("own_skip").type == table.schema.field("skipped").type
    assert _flags(table, "skipped") == {step: {v} for step, v in SKIPPED.items()}
    assert _flags(table, "own_skip") == {step: {v} for step, v in OWN_SKIP.items()}
    rows = trainermon.load(tmp_path / "out", family="grad_reduced", columns=["step", "own_skip"]).to_pylist()
    assert {(r["step"], r["own_skip"]) for r in rows} == set(OWN_SKIP.items())


def test_parquet_files_without_own_skip_still_load(tmp_path):
    """A file written before the column existed (rewritten here without it, metadata kept) loads beside a
    new one: its `own_skip` is null, its `skipped` as written; the analysis reads the dataset too."""
    _write(ParquetExporter(), tmp_path)
    (part,) = glob.glob(str(tmp_path / "out" / "parquet" / "family=grad_reduced" / "rank=0" / "*.parquet"))
    old = pq.read_table(part)
    old = old.drop_columns(["own_skip"]).replace_schema_metadata(old.schema.metadata)
    pq.write_table(old, part)
    assert "own_skip" not in pq.read_schema(part).names
    table = trainermon.load(tmp_path / "out", family="grad_reduced")
    assert _flags(table, "skipped") == {step: {v} for step, v in SKIPPED.items()}
    assert _flags(table, "own_skip") == {step: {None} for step in CASES}
    from trainermon.analysis import open_run

    source = open_run(str(tmp_path / "out"))
    assert source.kind == "parquet" and source.families() == ["grad_reduced"]
    steps = np.concatenate([b.step for b in source.iter_batches(stats=["norm"])])
    assert sorted(steps.tolist()) == sorted(list(CASES) * len(NAMES))
