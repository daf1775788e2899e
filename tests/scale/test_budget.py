"""The Prometheus series budget: how many series each rank of a large job exposes under the defaults.

No job runs: for each kind of rank of a Megatron GPT layout (pipeline stage; writer of the stage's reduced
gradients or not; rank 0, which also writes the cross-rank summaries) the test opens the real exporter
with that rank's RunInfo, feeds it a StatBatch holding that rank's rows (the tensors the rank holds,
named as trainermon names them) and counts the series its page exposes (every sample on it).
docs/EXPORTERS.md shows the figures; the test asserts that the table there is the one computed here
(TRAINERMON_WRITE_DOCS=1 rewrites it).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from trainermon.collect.records import XRANK_COLUMNS, RowMeta, StatBatch
from trainermon.collect.xrank import XRankTable
from trainermon.config import parse_config
from trainermon.config.parse import ConfigError
from trainermon.exporters import RunInfo
from trainermon.exporters.prometheus import PrometheusExporter

DOC = Path(__file__).resolve().parents[2] / "docs" / "EXPORTERS.md"
START, END = "<!-- series-budget:start -->", "<!-- series-budget:end -->"
#: Megatron-core's GPT layer (local spec), per transformer layer.
LAYER_PARAMS = (
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
)


@dataclass(frozen=True)
class Job:
    label: str
    tp: int
    pp: int
    dp: int
    layers: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def stage_params(self, stage: int) -> list[str]:
        """The parameters a rank of `stage` holds (global layer numbers, embeddings shared with the last
        stage, whose copy is its `output_layer.weight`)."""
        per = self.layers // self.pp
        names = (
            ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"] if stage == 0 else []
        )
        names += [
            f"decoder.layers.{i}.{p}" for i in range(stage * per, (stage + 1) * per) for p in LAYER_PARAMS
        ]
        if stage == self.pp - 1:
            names += ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]
        return names


JOBS = (
    Job("1024 ranks: GPT, 96 layers, TP8 x PP8 x DP16", tp=8, pp=8, dp=16, layers=96),
    Job("10,000 ranks: GPT, 100 layers, TP8 x PP10 x DP125", tp=8, pp=10, dp=125, layers=100),
)
CONFIGS = (
    ("defaults, wg_distribution on", {}),
    ("ops norm, mean, min, max, nans, infs", {"ops": ["norm", "mean", "min", "max", "nans", "infs"]}),
    ("the same, prometheus.per_rank on", {"ops": ["norm", "mean", "min", "max", "nans", "infs"],
                                          "prometheus": {"per_rank": True}}),
)  # fmt: skip


def _batch(job: Job, stage: int, writer: bool, rank0: bool, config) -> StatBatch:
    rows: list[RowMeta] = []
    params = job.stage_params(stage)
    for name in params:
        rows.append(RowMeta("grad_unreduced", 0, name, None, (64, 64), torch.bfloat16, 4096))
    if writer:  # the stage's reduced gradients, merged over TP and DP; the shared embedding copy not again
        shared = stage == job.pp - 1 and job.pp > 1
        rows += [
            r._replace(family="grad_reduced")
            for r in rows
            if not (shared and r.name == "output_layer.weight")
        ]
    n = len(rows)
    rng = np.random.default_rng(0)
    values = {s: rng.random(n) for s in ("norm", "mean", "min", "max", "zeros")}
    values.update(nans=np.zeros(n), infs=np.zeros(n), numel=np.full(n, 4096.0))
    xrank = None
    if rank0:  # the summaries of every rank's grad_unreduced rows: the union over the stages
        stats = tuple(s for s in ("norm", "mean", "min", "max", "zeros") if s in config.ops) or ("norm",)
        keys = [
            ("grad_unreduced", 0, p, None, s)
            for st in range(job.pp)
            for p in job.stage_params(st)
            for s in stats
        ]
        m = len(keys)
        xvalues = {c: rng.random(m) for c in XRANK_COLUMNS}
        xvalues.update({c: np.zeros(m, dtype=np.int64) for c in ("max_rank", "min_rank", "nans", "infs")})
        xvalues.update(nonfinite_rank=np.full(m, -1), ranks=np.full(m, job.dp * job.tp))
        xrank = XRankTable(tuple(keys), xvalues)
    return StatBatch(10, rows, values, xrank=xrank)


def _series(job: Job, rank: int, stage: int, writer: bool, raw: dict, tmp: Path) -> int:
    config = parse_config({"wg_distribution": True, "format": ["prometheus"], **raw,
                           "prometheus": {"sd_dir": None, **raw.get("prometheus", {})}})  # fmt: skip
    exporter = PrometheusExporter()
    exporter.open(RunInfo(str(tmp / f"rank{rank}"), str(tmp), rank, job.world, "abcd1234", config))
    try:
        exporter.write(_batch(job, stage, writer, rank == 0, config))
        assert exporter.m.series_dropped.labels(str(rank))._value.get() == 0  # within max_series
        return sum(len(metric.samples) for metric in exporter.exposed.collect())  # the page's samples
    finally:
        exporter.close()


def compute(tmp: Path) -> list[tuple[str, str, int, int, int, int]]:
    """(job, config, series on rank 0, on a writing rank, on another rank, job total) per case."""
    out = []
    for job in JOBS:
        for label, raw in CONFIGS:
            total = 0
            # Ranks of a stage: tp x dp, of which one (tp = dp = 0) writes the reduced gradients.
            per_stage = job.tp * job.dp
            first_rank_of_stage = [s * per_stage for s in range(job.pp)]
            rank0 = writer = other = 0
            for stage in range(job.pp):
                w = _series(job, first_rank_of_stage[stage], stage, True, raw, tmp)
                o = _series(job, first_rank_of_stage[stage] + 1, stage, False, raw, tmp)
                if stage == 0:
                    rank0 = w
                else:
                    writer = max(writer, w)
                other = max(other, o)
                total += w + (per_stage - 1) * o
            out.append((job.label, label, rank0, writer, other, total))
    return out


def render(rows) -> str:
    lines = [
        "| job | config | rank 0 | a writing rank (max) | any other rank (max) | job total |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {j} | {c} | {r0:,} | {w:,} | {o:,} | {t:,} |" for j, c, r0, w, o, t in rows]
    return "\n".join(lines)


def test_series_budget_matches_docs(tmp_path):
    table = render(compute(tmp_path))
    text = DOC.read_text(encoding="utf-8")
    if os.environ.get("TRAINERMON_WRITE_DOCS") == "1":
        text = re.sub(f"{START}.*?{END}", f"{START}\n{table}\n{END}", text, flags=re.S)
        DOC.write_text(text, encoding="utf-8")
    doc_table = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert doc_table == table, "docs/EXPORTERS.md is out of date: rerun with TRAINERMON_WRITE_DOCS=1"


def test_budget_keeps_targets_and_one_rank(tmp_path):
    """Per-rank rows: of `targets` only on a rank of many; all of them when the job has one rank."""
    job = Job("small", tp=1, pp=1, dp=2, layers=2)

    def layers(rank: int, world: int, raw: dict) -> set[str]:
        config = parse_config(
            {"wg_distribution": True, "format": ["prometheus"], "prometheus": {"sd_dir": None}, **raw}
        )
        exporter = PrometheusExporter()
        exporter.open(RunInfo(str(tmp_path / f"r{rank}{world}"), str(tmp_path), rank, world, "id", config))
        try:
            exporter.write(_batch(job, 0, False, False, config))
            return {
                s.labels["layer"]
                for metric in exporter.m.registry.collect()
                for s in metric.samples
                if s.name == "trainermon_layer_stat" and s.labels["family"] == "grad_unreduced"
            }
        finally:
            exporter.close()

    assert layers(1, 2, {}) == set()
    assert layers(1, 2, {"targets": {"decoder.layers.1": {}}}) == {"decoder.layers.1"}
    everything = {"embedding.word_embeddings", "embedding.position_embeddings", "decoder.layers.0",
                  "decoder.layers.1", "decoder.final_layernorm", "output_layer"}  # fmt: skip
    assert layers(0, 1, {}) == everything
    assert layers(1, 2, {"prometheus": {"per_rank": True}}) == layers(0, 1, {})


def test_config_keys():
    assert parse_config({}).xrank_summary is True and parse_config({}).prometheus.per_rank is False
    assert parse_config({"xrank_summary": False}).xrank_summary is False
    with pytest.raises(ConfigError, match="'xrank_summary': got 'yes'.*true or false"):
        parse_config({"xrank_summary": "yes"})
    with pytest.raises(ConfigError, match="'prometheus.per_rank': got 1.*true or false"):
        parse_config({"prometheus": {"per_rank": 1}})
