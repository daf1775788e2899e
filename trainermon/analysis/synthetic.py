"""Synthetic trainermon Parquet datasets (the exporter's layout and schema) for tests and benchmarks.

`write_synthetic_dataset(root, ranks, steps, tensors)` writes `grad_reduced` rows: every rank holds
one shard of each of `tensors` tensors (as under tensor parallelism), one row per tensor per step, with
known features to find: a global-norm spike, one NaN, and a few tensors that grow over the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from trainermon.exporters.parquet_files import SCHEMA_VERSION, file_schema, part_name, write_dataset_marker

_KINDS = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight")


@dataclass(frozen=True)
class SyntheticTruth:
    """What was planted: the spike step, the NaN (step, rank, name), the growing tensors."""

    names: list[str]
    spike_step: int | None
    nan: tuple[int, int, str] | None
    growing: list[str]
    rows: int
    files: int
    bytes: int


def tensor_names(n: int) -> list[str]:
    return [f"layers.{i // len(_KINDS)}.{_KINDS[i % len(_KINDS)]}" for i in range(n)]


def write_synthetic_dataset(
    root: str | os.PathLike,
    ranks: int,
    steps: int,
    tensors: int,
    steps_per_part: int = 1000,
    family: str = "grad_reduced",
    spike_step: int | None = None,
    nan: tuple[int, int, int] | None = None,
    growing: int = 3,
    seed: int = 0,
    run_id: str = "synthetic",
) -> SyntheticTruth:
    """Write the dataset; `nan` = (step, rank, tensor index) gets a NaN norm and nans=1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    write_dataset_marker(root)
    rng = np.random.default_rng(seed)
    names = tensor_names(tensors)
    base = np.exp(rng.normal(0.0, 1.0, tensors))  # per-tensor scale
    grow = np.zeros(tensors)
    grow_idx = rng.choice(tensors, size=min(growing, tensors), replace=False) if growing else []
    grow[grow_idx] = np.log(8.0)  # these end the run about 8x larger
    shape_rows, shape_cols = 64, 32
    numel = shape_rows * shape_cols
    schema = file_schema()
    name_dict = pa.array(names, pa.string())
    dtype_dict = pa.array(["torch.bfloat16"], pa.string())
    rows = files = size = 0
    for rank in range(ranks):
        shard = np.exp(rng.normal(0.0, 0.1, tensors))  # each rank's shard has its own scale
        for seq, first in enumerate(range(0, steps, steps_per_part)):
            last = min(first + steps_per_part, steps) - 1
            n_steps = last - first + 1
            step = np.repeat(np.arange(first, last + 1, dtype=np.int64), tensors)
            tidx = np.tile(np.arange(tensors), n_steps)
            frac = step / max(steps - 1, 1)
            noise = np.exp(rng.normal(0.0, 0.03, step.size))
            norm = base[tidx] * shard[tidx] * np.exp(grow[tidx] * frac) * noise
            if spike_step is not None:
                norm = np.where(step == spike_step, norm * 20.0, norm)
            nans = np.zeros(step.size, dtype=np.int64)
            if nan is not None and nan[1] == rank:
                hit = (step == nan[0]) & (tidx == nan[2])
                norm = np.where(hit, np.nan, norm)
                nans[hit] = 1
            rms = norm / np.sqrt(numel)
            mean = rms * rng.normal(0.0, 0.05, step.size)
            n = step.size
            arrays = [
                pa.repeat(pa.scalar(run_id), n),
                pa.array(np.zeros(n, dtype=np.int32)),
                name_dict.take(pa.array(tidx)),
                pa.array(step),
                pa.nulls(n, pa.int32()),
                pa.array(norm),
                pa.array(mean),
                pa.array(-3.0 * rms),
                pa.array(3.0 * rms),
                pa.array(np.zeros(n)),
                pa.array(nans),
                pa.array(np.zeros(n, dtype=np.int64)),
                pa.array(np.full(n, numel, dtype=np.int64)),
                pa.ListArray.from_arrays(
                    pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32)),
                    pa.array(np.tile(np.array([shape_rows, shape_cols], dtype=np.int64), n)),
                ),
                dtype_dict.take(pa.array(np.zeros(n, dtype=np.int64))),
                pa.nulls(n, pa.string()),
                pa.nulls(n, pa.bool_()),  # skipped: not known
                pa.nulls(n, pa.int64()),  # calls: comm rows only
                pa.nulls(n, pa.int64()),  # bytes: comm rows only
            ]
            arrays += [pa.nulls(n, f.type) for f in list(schema)[len(arrays) :]]  # columns of other families
            meta = {
                "trainermon.schema_version": str(SCHEMA_VERSION),
                "trainermon.family": family,
                "trainermon.rank": str(rank),
                "trainermon.run_id": run_id,
                "trainermon.first_step": str(first),
                "trainermon.last_step": str(last),
                "trainermon.synthetic": "true",
            }
            table = pa.Table.from_arrays(
                arrays, schema=schema.with_metadata({k.encode(): v.encode() for k, v in meta.items()})
            )
            directory = os.path.join(root, f"family={family}", f"rank={rank}")
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, part_name(first, last, run_id, seq))
            pq.write_table(table, path, compression="zstd", row_group_size=max(n, 1))
            rows += n
            files += 1
            size += os.path.getsize(path)
    nan_truth = None if nan is None else (nan[0], nan[1], names[nan[2]])
    return SyntheticTruth(names, spike_step, nan_truth, [names[i] for i in grow_idx], rows, files, size)
