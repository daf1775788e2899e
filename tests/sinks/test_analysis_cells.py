"""Comparison cell by cell: msprobe layouts, NaN rules, names in one run only, first divergence."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import trainermon
from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.analysis import (
    analyze,
    compare,
    find_spikes,
    global_grad_norm,
    heatmap,
    open_run,
    relative_difference,
    scan,
)
from trainermon.cli import main


def _write_csv(path: Path, header: str, rows: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "\n" + "\n".join(rows) + "\n")


def test_msprobe_layout_ranks_copies_and_shards(tmp_path):
    root = tmp_path / "ms"
    # Two data-parallel ranks: msprobe writes the replicated reduced gradient on both (copies).
    for rank in (0, 1):
        _write_csv(
            root / f"Jan01_00-00-00-rank{rank}-abc" / "grad_reduced_0-1.csv",
            "name,step,norm,max",
            ["0:layers.0.weight,0,3.0,1", "0:layers.1.weight,0,4.0,2", "0:layers.0.weight,1,6.0,1"]
            + ["0:layers.1.weight,1,8.0,2"],
        )
    # Activations differ per rank and micro-step: a cell holds all of them.
    _write_csv(
        root / "Jan01_00-00-00-rank0-abc" / "actv_0-1.csv",
        "vpp_stage,name,step,micro_step,norm,min,max,mean,shape,dtype",
        ['0,layers.0.output,0,0,1.0,-1,1,0.5,"[2, 4]",torch.bfloat16']
        + ['0,layers.0.output,0,1,2.0,-2,3,0.25,"[2, 4]",torch.bfloat16']
        + ['1,layers.9.output,0,0,nan,-1,1,0.5,"[2, 4]",torch.bfloat16'],
    )
    _write_csv(
        root / "Jan01_00-00-00-rank1-abc" / "actv_0-1.csv",
        "vpp_stage,name,step,micro_step,norm,min,max,mean,shape,dtype",
        ['0,layers.0.output,0,0,2.0,-4,1,0.0,"[4, 4]",torch.bfloat16'],
    )
    src = open_run(root)
    assert src.kind == "msprobe-csv" and src.ranks() == [0, 1]
    summary = scan(src)
    assert summary.copies == {("grad_reduced", 1): 0}  # rank 1's rows copy rank 0's: counted once
    assert any("counted once" in n for n in summary.notes)
    norm = global_grad_norm(summary)
    assert norm.to_dict() == {0: pytest.approx(5.0), 1: pytest.approx(10.0)}
    grad = heatmap(summary, "grad_reduced", "norm")
    assert list(grad.index) == ["layers.0.weight", "layers.1.weight"]  # "0:" prefix removed
    act = heatmap(summary, "actv", "norm")
    # vpp stage 1 sorts after stage 0 and is labelled msprobe's way; its NaN is kept.
    assert list(act.index) == ["0:layers.0.output", "1:layers.9.output"]
    assert act.loc["0:layers.0.output", 0] == pytest.approx(3.0)  # sqrt(1 + 4 + 4): 2 micro x 2 ranks
    assert math.isnan(act.loc["1:layers.9.output", 0])
    assert heatmap(summary, "actv", "min").loc["0:layers.0.output", 0] == -4
    assert heatmap(summary, "actv", "max").loc["0:layers.0.output", 0] == 3
    # mean weighted by numel from the shape column: (8*0.5 + 8*0.25 + 16*0) / 32
    assert heatmap(summary, "actv", "mean").loc["0:layers.0.output", 0] == pytest.approx(6 / 32)
    first = trainermon.analysis.first_nonfinite(summary)
    assert (first.loc[0, "family"], first.loc[0, "name"], first.loc[0, "vpp_stage"]) == (
        "actv",
        "layers.9.output",
        1,
    )
    # `--stat norm` reads min/max/mean to tell copies (grid.with_copy_marks); its table shows the norm
    first = analyze(root, stats=["norm"], progress=False).first_nonfinite
    assert first.loc[0, "name"] == "layers.9.output" and not {"min", "max", "mean"} & set(first.columns)


def test_shards_with_different_values_are_summed(tmp_path):
    # Tensor-parallel shards of one tensor (different values on each rank) combine into one norm;
    # a tensor-parallel-replicated parameter (identical rows) counts once.
    for rank, (shard, replicated) in enumerate([(3.0, 2.0), (4.0, 2.0)]):
        _write_csv(
            tmp_path / "tp" / f"Jan01_00-00-00-rank{rank}-x" / "grad_reduced_0-0.csv",
            "vpp_stage,name,step,norm",
            [f"0,attn.qkv.weight,0,{shard}", f"0,norm.weight,0,{replicated}"],
        )
    summary = scan(open_run(tmp_path / "tp"))
    assert summary.copies == {}
    grad = heatmap(summary, "grad_reduced", "norm")
    assert grad.loc["attn.qkv.weight", 0] == pytest.approx(5.0)
    assert grad.loc["norm.weight", 0] == pytest.approx(2.0)
    assert global_grad_norm(summary)[0] == pytest.approx(math.sqrt(25 + 4))


@pytest.mark.parametrize("engine", ["pyarrow", "duckdb"])
def test_equal_norms_with_other_values_are_pieces_not_copies(tmp_path, engine):
    """A LayerNorm output's norm is about sqrt(numel) whatever its input, so at CSV's 6 digits every rank
    writes the same norm for its own activations while min, max and mean differ: two pieces (norm x
    sqrt(2)), which were counted once as copies. Rows equal in every value are still one tensor."""
    pytest.importorskip(engine)
    header = "vpp_stage,name,step,micro_step,norm,min,max,mean"
    for rank, (lo, hi, mean) in enumerate([(-2.9497, 3.1, 0.01), (-3.02002, 2.8, -0.02)]):
        _write_csv(
            tmp_path / "csv" / f"Jan01_00-00-00-rank{rank}-x" / "actv_0-0.csv",
            header,
            [f"0,ln.output,0,0,45.2546,{lo},{hi},{mean}", "0,tp_replicated.output,0,0,7.5,-1,1,0.25"],
        )
    from trainermon.convert import convert

    convert(tmp_path / "csv", tmp_path / "pq")
    source = tmp_path / ("csv" if engine == "pyarrow" else "pq")
    result = analyze(source, engine=engine, progress=False)
    norm = result.heatmaps[("actv", "norm")]
    assert norm.loc["ln.output", 0] == pytest.approx(45.2546 * math.sqrt(2), rel=1e-12)
    assert norm.loc["tp_replicated.output", 0] == pytest.approx(7.5, rel=1e-12)
    assert result.heatmaps[("actv", "min")].loc["ln.output", 0] == -3.02002
    # the same whatever the statistics asked for: `--stat norm` alone still tells copies by all four
    alone = analyze(source, engine=engine, stats=["norm"], progress=False).heatmaps[("actv", "norm")]
    assert alone.loc["ln.output", 0] == pytest.approx(45.2546 * math.sqrt(2), rel=1e-12)
    assert alone.loc["tp_replicated.output", 0] == pytest.approx(7.5, rel=1e-12)
    # compare (norm by default) against the same numbers written as one row per tensor
    _write_csv(
        tmp_path / "whole" / "Jan01_00-00-00-rank0-y" / "actv_0-0.csv",
        header,
        [
            f"0,ln.output,0,0,{45.2546 * math.sqrt(2)!r},-3.02002,3.1,-0.005",
            "0,tp_replicated.output,0,0,7.5,-1,1,0.25",
        ],
    )
    convert(tmp_path / "whole", tmp_path / "whole_pq")
    whole = tmp_path / ("whole" if engine == "pyarrow" else "whole_pq")
    found = compare(source, whole, engine=engine, progress=False)
    assert found.first is None and float(found.per_family["max_rel_diff"].max()) < 1e-12, found.per_family


def test_spike_rule():
    import pandas as pd

    rng = np.random.default_rng(0)
    values = np.exp(rng.normal(0, 0.05, 200)) * np.linspace(1, 3, 200)  # a slow trend is no spike
    values[120] *= 4
    values[121] = np.nan  # skipped, not a spike
    spikes = find_spikes(pd.Series(values, index=range(200)))
    assert spikes["step"].tolist() == [120]
    assert spikes.loc[0, "baseline"] == pytest.approx(values[100:120].mean(), rel=0.1)


def test_relative_difference_definition():
    rel = relative_difference([1.01, 0.0, 1e-20, np.nan], [1.0, 0.0, 0.0, 1.0])
    assert rel[0] == pytest.approx(0.01) and rel[1] == 0.0 and rel[2] == pytest.approx(1e-8)
    assert np.isnan(rel[3])


def test_nan_in_one_run_only_diverges_both_nan_do_not(tmp_path):
    def write(where: Path, values: list[str]) -> None:
        _write_csv(
            where / "Jan01_00-00-00-rank0-r" / "grad_reduced_0-2.csv",
            "vpp_stage,name,step,norm",
            [f"0,w,{s},{v}" for s, v in enumerate(values)],
        )

    write(tmp_path / "a", ["1.0", "nan", "nan"])
    write(tmp_path / "b", ["1.0", "nan", "2.0"])
    result = compare(tmp_path / "a", tmp_path / "b")
    assert (result.first.step, result.first.name) == (2, "w")  # step 1: NaN in both is no divergence
    assert result.first.rel_diff == math.inf
    assert result.per_family.loc[0, "cells_divergent"] == 1


def test_empty_tensors_are_no_nan(tmp_path):
    # A tensor without elements has NaN mean/min/max by definition: not a NaN to report.
    _write_csv(
        tmp_path / "r" / "Jan01_00-00-00-rank0-r" / "grad_reduced_0-0.csv",
        "vpp_stage,name,step,norm,mean,min,max,numel",
        ["0,empty.weight,0,0,nan,nan,nan,0", "0,w,0,2.0,0.1,-1,1,4", "0,w2,0,nan,nan,nan,nan,4"],
    )
    summary = scan(open_run(tmp_path / "r"))
    first = trainermon.analysis.first_nonfinite(summary)
    assert first["name"].tolist() == ["w2"]
    bad = trainermon.analysis.nonfinite_cells(summary, "grad_reduced")
    assert bad[0].to_dict() == {"empty.weight": False, "w": False, "w2": True}
    assert math.isnan(heatmap(summary, "grad_reduced", "mean").loc["empty.weight", 0])
    assert heatmap(summary, "grad_reduced", "norm").loc["empty.weight", 0] == 0.0


@pytest.mark.parametrize(
    "prefer, engine", [("csv", "pyarrow"), ("parquet", "pyarrow"), ("parquet", "duckdb")]
)
def test_the_nan_row_of_a_none_output_is_not_the_first_nan(tmp_path, out_dir, prefer, engine):
    """A module returning (x, None) gets msprobe's NaN row for the None (shape [], dtype None): analyze
    reported it as the run's first NaN at step 0, hiding the real one (step 2 here)."""

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x), None  # as HF attention without output_attentions

    model = torch.nn.Sequential()
    model.attn = Attn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ops = ["norm", "min", "max", "mean"]
    monitor = TrainerMon(
        write_config(tmp_path / "c.json", xy_distribution=True, ops=ops, format=["csv", "parquet"])
    )
    monitor.set_monitor(model, optimizer=opt)
    for step in range(4):
        x = torch.ones(2, 4)
        x[0, 0] = math.nan if step == 2 else 1.0
        model.attn(x)[0].sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    placeholder = [r for r in read_family(monitor.run_dir, "actv") if r["name"] == "attn.output_1"]
    assert len(placeholder) == 4 and all(r["norm"] == "nan" and r["dtype"] == "None" for r in placeholder)
    first = analyze(open_run(out_dir, prefer=prefer), engine=engine, progress=False).first_nonfinite
    assert (first.loc[0, "step"], first.loc[0, "name"]) == (2, "attn.fc.input"), first.head(3)
    assert "attn.output_1" not in first["name"].tolist()


# ---- names in one run only ---------------------------------------------------------------------------
def test_names_only_in_one_run_are_listed(tmp_path, capsys):
    head = "vpp_stage,name,step,norm"
    _write_csv(
        tmp_path / "run" / "Jan01_00-00-00-rank0-r" / "grad_reduced_0-1.csv",
        head,
        [f"0,{n},{s},1.0" for s in (0, 1) for n in ("a.weight", "b.weight", "c.weight")],
    )
    _write_csv(
        tmp_path / "bench" / "Jan01_00-00-00-rank0-b" / "grad_reduced_0-1.csv",
        head,
        [f"0,{n},{s},1.0" for s in (0, 1) for n in ("a.weight", "b.weight", "d.weight")],
    )
    _write_csv(tmp_path / "bench" / "Jan01_00-00-00-rank0-b" / "exp_avg_0-1.csv", head, ["0,a.weight,0,1.0"])
    result = compare(tmp_path / "run", tmp_path / "bench")
    assert result.first is None
    assert result.only_in_run.to_dict("records") == [
        {"family": "grad_reduced", "vpp_stage": 0, "name": "c.weight"}
    ]
    assert result.only_in_benchmark["name"].tolist() == ["d.weight"]
    assert result.families_only_in_benchmark == ["exp_avg"] and result.families_only_in_run == []
    row = result.per_family.iloc[0]
    assert (row["tensors_compared"], row["only_in_run"], row["only_in_benchmark"]) == (2, 1, 1)
    assert row["cells_compared"] == 4
    code = main(["compare", str(tmp_path / "run"), str(tmp_path / "bench"), "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert code == 0
    assert "only in run: grad_reduced c.weight" in out and "only in benchmark: grad_reduced d.weight" in out
    assert "families only in the run: [], only in the benchmark: ['exp_avg']" in out
    found = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert found["only_in_run"][0]["name"] == "c.weight"


def test_first_divergence_reports_one_statistic_and_a_missing_one_is_named(tmp_path, capsys):
    """With --stat max --stat norm, the first divergence named `max` with its values but carried the
    larger relative difference of `norm`; a statistic neither run recorded was 'no shared names'."""
    head = "vpp_stage,name,step,norm,max"
    for run, norm, big in (("run", 2.0, 1.0), ("bench", 4.0, 2.5)):  # max: 0.6 apart; norm: 0.5
        _write_csv(
            tmp_path / run / f"Jan01_00-00-00-rank0-{run}" / "grad_reduced_0-0.csv",
            head,
            [f"0,w,0,{norm},{big}"],
        )
    for stats, want in (
        (["max", "norm"], ("max", 1.0, 2.5, 0.6)),
        (["norm", "max"], ("norm", 2.0, 4.0, 0.5)),
    ):
        first = compare(tmp_path / "run", tmp_path / "bench", stats=stats).first
        assert (first.stat, first.run_value, first.benchmark_value) == want[:3]
        assert first.rel_diff == pytest.approx(want[3], rel=1e-12)
    code = main(
        [
            "compare",
            str(tmp_path / "run"),
            str(tmp_path / "bench"),
            "--stat",
            "mean",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2
    assert "no cell compared: grad_reduced: ['mean'] not in both runs" in capsys.readouterr().err


def test_zero_cells_compared_is_an_error_with_names(tmp_path, capsys):
    """Two runs without one (family, name, step) in common: exit 2, saying why and showing names, never
    "no divergence" (which is what comparing nothing used to print)."""
    head = "vpp_stage,name,step,norm"
    _write_csv(
        tmp_path / "run" / "Jan01_00-00-00-rank0-r" / "grad_reduced_0-1.csv",
        head,
        [f"0,{n},{s},1.0" for s in (0, 1) for n in ("enc.a.weight", "enc.b.weight")],
    )
    _write_csv(
        tmp_path / "bench" / "Jan01_00-00-00-rank0-b" / "grad_reduced_0-1.csv",
        head,
        [f"0,{n},{s},1.0" for s in (0, 1) for n in ("dec.a.weight", "dec.b.weight")],
    )
    with pytest.raises(ValueError, match="no cell compared"):
        compare(tmp_path / "run", tmp_path / "bench")
    code = main(["compare", str(tmp_path / "run"), str(tmp_path / "bench"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2
    assert "no cell compared" in err and "enc.a.weight" in err and "dec.a.weight" in err
    # No family in common at all: the same, naming the families.
    os.rename(
        tmp_path / "bench" / "Jan01_00-00-00-rank0-b" / "grad_reduced_0-1.csv",
        tmp_path / "bench" / "Jan01_00-00-00-rank0-b" / "exp_avg_0-1.csv",
    )
    code = main(["compare", str(tmp_path / "run"), str(tmp_path / "bench"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "share no family" in err and "exp_avg" in err
