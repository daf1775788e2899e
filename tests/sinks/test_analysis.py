"""Offline analysis: `trainermon analyze` and `trainermon compare` on real monitored runs, msprobe CSV,
and a synthetic multi-rank dataset (bounded memory)."""

from __future__ import annotations

import csv
import gc
import glob
import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import trainermon
from tests.helpers import LayeredNet, read_family, write_config
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
from trainermon.analysis.progress import Progress
from trainermon.analysis.report import write_analysis_report, write_comparison_report
from trainermon.analysis.synthetic import write_synthetic_dataset
from trainermon.cli import main

OPS = ["norm", "min", "max", "mean", "nans", "infs"]
STEPS = 12
SCALE_STEP = 5  # layers.1.weight x 1.05 before the optimizer step of this step
NOISE_STEP = 7  # noise added to head.weight's gradient at this step
SPIKE_STEP = 14  # loss x 100 at this step
NAN_STEP = 20  # a NaN in layers.0.bias's gradient at this step


def train(out: Path, steps: int = STEPS, perturb=None, loss_scale=None, alert: bool = False) -> dict:
    """A seeded monitored run of LayeredNet (wg, param and mv families; CSV and Parquet at once).

    perturb(step, model) runs after backward and before the optimizer step. Returns the output
    directory, the rank's run directory and the true global gradient norm of every step."""
    cfg_keys: dict = dict(
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        ops=OPS,
        format=["csv", "parquet"],
        step_count_per_record=100,
    )
    if alert:
        cfg_keys["alert"] = {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}
    cfg = write_config(out.parent / f"{out.name}.json", **cfg_keys)
    old = os.environ.get("MONITOR_OUTPUT_DIR")
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    try:
        torch.manual_seed(0)
        model = LayeredNet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = TrainerMon(cfg)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        gen = torch.Generator().manual_seed(1)
        norms = {}
        for step in range(steps):
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
            loss = (model(x) - y).pow(2).mean()
            if loss_scale is not None:
                loss = loss * loss_scale(step)
            loss.backward()
            if perturb is not None:
                perturb(step, model)
            grads = [p.grad.double() for p in model.parameters()]
            norms[step] = math.sqrt(sum(float(g[torch.isfinite(g)].pow(2).sum()) for g in grads))
            opt.step()
            opt.zero_grad()
        mon.close()
    finally:
        if old is None:
            os.environ.pop("MONITOR_OUTPUT_DIR", None)
        else:
            os.environ["MONITOR_OUTPUT_DIR"] = old
    return {"out": out, "run_dir": mon.run_dir, "norms": norms}


def _scale_layer1(step, model):
    if step == SCALE_STEP:
        with torch.no_grad():
            model.layers[1].weight.mul_(1.05)


def _noise_head(step, model):
    if step == NOISE_STEP:
        gen = torch.Generator().manual_seed(5)
        g = model.head.weight.grad
        g.add_(torch.randn(g.shape, generator=gen) * g.norm() / math.sqrt(g.numel()))


def _nan_bias(step, model):
    if step == NAN_STEP:
        model.layers[0].bias.grad[0] = float("nan")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        "base": train(root / "base"),
        "same": train(root / "same"),
        "scaled": train(root / "scaled", perturb=_scale_layer1),
        "noisy": train(root / "noisy", perturb=_noise_head),
        "trouble": train(
            root / "trouble",
            steps=24,
            perturb=_nan_bias,
            loss_scale=lambda s: 100.0 if s == SPIKE_STEP else 1.0,
            alert=True,
        ),
    }


def _source(run: dict, fmt: str):
    return open_run(run["out"], prefer=fmt)


# ---- compare on real runs --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_identical_runs_do_not_diverge(runs, fmt, tmp_path, capsys):
    src = _source(runs["base"], fmt)
    assert src.kind == fmt
    result = compare(src, _source(runs["same"], fmt), stats=["norm", "mean", "max"])
    assert result.first is None and not result.diverged
    table = result.per_family.set_index("family")
    families = ["grad_unreduced", "grad_reduced", "param_origin", "exp_avg", "exp_avg_sq", "param_updated"]
    assert list(table.index) == families
    assert (table["cells_compared"] == 6 * STEPS).all()  # 6 tensors x 12 steps, none dropped
    assert (table["cells_divergent"] == 0).all() and (table["max_rel_diff"] == 0).all()
    assert len(result.divergent) == 0 and len(result.only_in_run) == 0 and len(result.only_in_benchmark) == 0
    out = ["--out", str(tmp_path / "cmp")]
    code = main(["compare", str(runs["base"]["out"]), str(runs["same"]["out"]), "--format", fmt] + out)
    code_out = capsys.readouterr().out
    assert code == 0 and "no divergence" in code_out


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_scaled_layer_found_at_its_step(runs, fmt, tmp_path, capsys):
    result = compare(_source(runs["scaled"], fmt), _source(runs["base"], fmt))
    first = result.first
    assert first is not None
    # At SCALE_STEP only the scaled weight differs (param_origin is read after backward, before the
    # update); from the next step on every gradient differs, layers.0 first in model order.
    assert (first.step, first.family, first.name, first.micro_step) == (
        SCALE_STEP,
        "param_origin",
        "layers.1.weight",
        None,
    )
    assert first.rel_diff == pytest.approx(0.05, abs=2e-4)
    assert first.run_value == pytest.approx(first.benchmark_value * 1.05, rel=2e-4)
    table = result.per_family.set_index("family")
    assert table.loc["param_origin", "first_divergent_step"] == SCALE_STEP
    assert table.loc["param_updated", "first_divergent_tensor"] == "layers.1.weight"
    assert table.loc["grad_reduced", "first_divergent_step"] == SCALE_STEP + 1
    assert table.loc["grad_reduced", "first_divergent_tensor"] == "layers.0.weight"
    at_step = result.divergent[result.divergent["first_step"] == SCALE_STEP]
    assert set(at_step["name"]) == {"layers.1.weight"}
    assert set(at_step["family"]) == {"param_origin", "param_updated"}
    # Python API: the per-step series of the divergent tensor in both runs.
    series = result.series("param_origin", "layers.1.weight")
    assert (series.loc[: SCALE_STEP - 1, "rel_diff"] < 1e-5).all()
    assert series.loc[SCALE_STEP, "rel_diff"] > 0.01
    code = main(
        ["compare", str(runs["scaled"]["out"]), str(runs["base"]["out"]), "--format", fmt]
        + ["--out", str(tmp_path / "cmp")]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert f"first divergence: step {SCALE_STEP} param_origin layers.1.weight norm" in out


def test_gradient_noise_found_and_report(runs, tmp_path):
    result = compare(_source(runs["noisy"], "parquet"), _source(runs["base"], "parquet"), rtol=0.01)
    first = result.first
    # Plain PyTorch: both gradient families are read at the optimizer step, after the noise.
    assert (first.step, first.family, first.name) == (NOISE_STEP, "grad_unreduced", "head.weight")
    assert first.rel_diff > 0.01
    before = result.divergent[result.divergent["first_step"] < NOISE_STEP]
    assert len(before) == 0
    paths = write_comparison_report(result, tmp_path / "rep", max_plots=3)
    assert len(paths["png"]) == 3
    for path in paths["png"].values():
        _check_png(path)
    found = json.loads(Path(paths["json"]).read_text())
    assert found["diverged"] is True
    assert found["first_divergence"]["name"] == "head.weight"
    assert found["first_divergence"]["step"] == NOISE_STEP
    page = Path(paths["html"]).read_text()
    assert page.count("data:image/png;base64,") == 3 and "head.weight" in page


def test_a_looser_threshold_hides_a_small_difference(runs):
    # 5% on one weight: above the default 1%, below 10%; param_origin/param_updated only.
    result = compare(
        _source(runs["scaled"], "parquet"),
        _source(runs["base"], "parquet"),
        rtol=0.1,
        families=["param_origin"],
        steps=(0, SCALE_STEP),
    )
    assert result.first is None
    assert result.per_family.loc[0, "max_rel_diff"] == pytest.approx(0.05, abs=1e-4)


# ---- msprobe CSV --------------------------------------------------------------------------------------
def _as_msprobe(run_dir: str, dest: Path) -> Path:
    """Rewrite a trainermon CSV rank directory as old msprobe CSV: no vpp_stage column, "0:" names."""
    out = dest / "Jan01_00-00-00-rank0-feedbeef"
    out.mkdir(parents=True)
    for path in glob.glob(os.path.join(run_dir, "*.csv")):
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        header = [c for c in rows[0] if c != "vpp_stage"]
        with open(out / os.path.basename(path), "w", newline="") as fh:
            writer = csv.DictWriter(fh, header, extrasaction="ignore")
            writer.writeheader()
            for r in rows:
                writer.writerow({**r, "name": f"0:{r['name']}"})
    return dest


def test_msprobe_csv_of_a_real_run(runs, tmp_path):
    ms_base = _as_msprobe(runs["base"]["run_dir"], tmp_path / "ms_base")
    src = open_run(ms_base)
    assert src.kind == "msprobe-csv"
    # msprobe's CSV (benchmark) vs trainermon's Parquet (run) of the same training: no divergence.
    same = compare(_source(runs["same"], "parquet"), src)
    assert same.first is None and (same.per_family["cells_compared"] == 6 * STEPS).all()
    assert len(same.only_in_run) == 0 and len(same.only_in_benchmark) == 0
    found = compare(_source(runs["scaled"], "parquet"), src)
    assert (found.first.step, found.first.name) == (SCALE_STEP, "layers.1.weight")


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


# ---- analyze on a real run ----------------------------------------------------------------------------
def _check_png(path: str) -> None:
    from matplotlib import image

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 8_000, f"{path}: {len(data)} bytes"
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert float(pixels[..., :3].std()) > 0.05, f"{path}: an (almost) single-colour image"


def test_analyze_real_run(runs, tmp_path, capsys):
    run = runs["trouble"]
    result = analyze(run["out"], stats=["norm", "max"])
    assert result.summary.source.kind == "parquet"
    # Global gradient norm = the true norm of the model's gradient at every step before the NaN.
    norm = result.global_norm
    assert list(norm.index) == list(range(24))
    for step in range(NAN_STEP):
        assert norm[step] == pytest.approx(run["norms"][step], rel=1e-5), step
    assert math.isnan(norm[NAN_STEP])  # a NaN counted in a gradient makes the global norm NaN
    # The loss x 100 step is the one spike.
    assert result.spikes["step"].tolist() == [SPIKE_STEP]
    assert result.spikes.loc[0, "ratio"] > 20
    # First NaN: the gradient families at NAN_STEP (grad_unreduced runs first), layers.0.bias only.
    first = result.first_nonfinite
    assert (first.loc[0, "step"], first.loc[0, "family"], first.loc[0, "name"]) == (
        NAN_STEP,
        "grad_unreduced",
        "layers.0.bias",
    )
    assert first.loc[0, "nans"] == 1
    at_first = first[first["step"] == NAN_STEP]
    assert set(at_first["name"]) == {"layers.0.bias"}
    assert {"grad_reduced", "exp_avg", "param_updated"} <= set(at_first["family"])
    # Heatmap cells are the written statistics; layers in model order.
    rows = read_family(run["run_dir"], "grad_reduced")
    hm = result.heatmaps[("grad_reduced", "norm")]
    assert list(hm.index) == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
        "head.weight",
        "head.bias",
    ]
    for r in rows:
        if int(r["step"]) < NAN_STEP:
            assert hm.loc[r["name"], int(r["step"])] == pytest.approx(float(r["norm"]), rel=1e-5)
    assert result.anomalies and result.anomalies[0]["step"] == NAN_STEP
    # Given the dataset root instead, the anomalies of its output directory are found all the same.
    from_root = analyze(run["out"] / "parquet", families=["grad_reduced"], stats=["norm"])
    assert from_root.anomalies == result.anomalies

    paths = write_analysis_report(result, tmp_path / "report")
    found = json.loads(Path(paths["json"]).read_text())
    assert set(found) >= {
        "run",
        "steps",
        "heatmaps",
        "global_grad_norm",
        "spikes",
        "growth",
        "first_nonfinite",
        "anomalies",
        "figures",
    }
    assert found["first_nonfinite"]["first"]["name"] == "layers.0.bias"
    assert found["first_nonfinite"]["first"]["step"] == NAN_STEP
    assert [s["step"] for s in found["spikes"]] == [SPIKE_STEP]
    assert found["global_grad_norm"]["max_step"] == SPIKE_STEP
    assert found["anomalies"]["count"] == len(result.anomalies) > 0
    assert len(found["heatmaps"]) == 6 * 2  # 6 families x (norm, max)
    pngs = paths["png"]
    assert len(pngs) == 12 + 1 + 6  # heatmaps, global norm, growth per family
    for path in pngs.values():
        _check_png(path)
    page = Path(paths["html"]).read_text()
    assert page.count("data:image/png;base64,") == len(pngs)
    assert "layers.0.bias" in page and f"step {NAN_STEP}" in page

    cli_out = str(tmp_path / "cli")
    code = main(["analyze", str(run["out"]), "--family", "grad_reduced", "--stat", "norm", "--out", cli_out])
    out = capsys.readouterr().out
    assert code == 0
    assert f"first NaN/Inf: step {NAN_STEP} grad_reduced layers.0.bias" in out
    assert f"spikes at steps [{SPIKE_STEP}]" in out
    assert sorted(os.listdir(tmp_path / "cli")) == [
        "findings.json",
        "global_grad_norm.png",
        "growth_grad_reduced.png",
        "heatmap_grad_reduced_norm.png",
        "report.html",
    ]


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


def test_msprobe_module_prefixes_are_stripped_so_cells_align(runs, tmp_path, capsys):
    """msprobe names parameters through DDP/Float16Module (`module.module.layers.0.weight`): read as the
    model names them, the same training compares cell for cell."""
    ms = _as_msprobe(runs["base"]["run_dir"], tmp_path / "ms")
    for path in glob.glob(str(ms / "*" / "*.csv")):
        text = Path(path).read_text()
        Path(path).write_text(re.sub(r"(?m)^0:", "0:module.module.", text))
    assert (
        "0:module.module.layers.1.weight"
        in Path(glob.glob(str(ms / "*" / "grad_reduced_*.csv"))[0]).read_text()
    )
    same = compare(_source(runs["same"], "parquet"), ms)
    assert same.first is None and (same.per_family["cells_compared"] == 6 * STEPS).all()
    assert len(same.only_in_run) == 0 and len(same.only_in_benchmark) == 0


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


# ---- scale: streaming in bounded memory ------------------------------------------------------------
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _release_free_memory() -> None:
    """Hand freed memory back to the OS first, so that reused free memory does not hide an increase."""
    import ctypes

    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import pyarrow.dataset, pandas
    import trainermon
    from trainermon.analysis import analyze
    def kb(key):
        with open("/proc/self/status") as fh:
            return next(int(l.split()[1]) for l in fh if l.startswith(key + ":"))
    base = kb("VmRSS")
    if sys.argv[2] == "analyze":
        a = analyze(sys.argv[1], stats=["norm"], batch_size=16384)
        rows = a.summary.rows_read
    else:
        rows = len(trainermon.load(sys.argv[1], columns=["rank", "name", "step", "norm"]).to_pandas())
    print(json.dumps({"increase_kb": kb("VmHWM") - base, "rows": rows}))
    """
)


def _peak_increase_kb(what: str, root: Path):
    """Peak RSS increase of running `what` ("analyze" or "load": materialise the same rows) over the
    RSS before it: in this process when the peak can be reset, else in a fresh subprocess."""
    if _reset_peak():
        _release_free_memory()
        _reset_peak()
        base = _status_kb("VmRSS")
        if what == "analyze":
            result = analyze(root, stats=["norm"], batch_size=16384)
            rows = result.summary.rows_read
        else:
            result = trainermon.load(root, columns=["rank", "name", "step", "norm"]).to_pandas()
            rows = len(result)
        increase = _status_kb("VmHWM") - base
        return increase, rows, result
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(root), what], capture_output=True, text=True, check=True
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return got["increase_kb"], got["rows"], None


def test_synthetic_multi_rank_dataset_streams_in_bounded_memory(tmp_path, record_property):
    ranks, steps, tensors = 32, 300, 100  # 960,000 rows
    truth = write_synthetic_dataset(
        tmp_path / "ds", ranks, steps, tensors, steps_per_part=100, spike_step=200, nan=(250, 7, 42)
    )
    assert truth.rows == ranks * steps * tensors and truth.files == ranks * 3
    analyze_kb, rows, result = _peak_increase_kb("analyze", tmp_path / "ds")
    load_kb, load_rows, _ = _peak_increase_kb("load", tmp_path / "ds")
    record_property("analyze_peak_rss_increase_mb", analyze_kb / 1024)
    record_property("materialise_peak_rss_increase_mb", load_kb / 1024)
    print(
        f"\n{rows:,} rows: analyze peak RSS +{analyze_kb / 1024:.1f} MiB; "
        f"materialising 4 columns with trainermon.load + pandas: +{load_kb / 1024:.1f} MiB"
    )
    assert rows == load_rows == truth.rows
    # Streaming keeps memory to the result (100 tensors x 300 steps) plus a batch of 16,384 rows.
    assert analyze_kb < 100 * 1024
    assert analyze_kb < load_kb / 3
    if result is not None:
        assert result.spikes["step"].tolist() == [200]
        first = result.first_nonfinite.iloc[0]
        assert (first["step"], first["rank"], first["name"]) == (250, 7, truth.nan[2])
        top = result.growth["grad_reduced"]["layer"].head(3).tolist()
        assert sorted(top) == sorted(truth.growing)
        # Every rank holds a shard of each tensor: the global norm sums all ranks' squares.
        table = trainermon.load(tmp_path / "ds", steps=10, columns=["norm"])
        want = math.sqrt(float(np.sum(np.square(table.column("norm").to_numpy()))))
        assert result.global_norm[10] == pytest.approx(want, rel=1e-12)


def test_filters_and_projection_are_pushed_down(tmp_path):
    write_synthetic_dataset(tmp_path / "ds", 4, 60, 10, steps_per_part=20)
    src = open_run(tmp_path / "ds")
    assert len(src.files) == 4 * 3
    chosen = src.select(steps=(25, 30), ranks=[1, 3])
    assert [(f.rank, f.first_step) for f in chosen] == [(1, 20), (3, 20)]  # other parts not opened
    batches = list(src.iter_batches(steps=(25, 30), ranks=[1, 3], stats=["max"], batch_size=7))
    assert all(len(b) <= 7 and set(b.stats) == {"max"} for b in batches)
    assert sum(len(b) for b in batches) == 2 * 6 * 10
    assert {int(s) for b in batches for s in b.step} == set(range(25, 31))
    summary = scan(src, steps=(25, 30), ranks=[1, 3], stats=["norm"])
    assert list(heatmap(summary, "grad_reduced").columns) == list(range(25, 31))
    assert summary.files_read == 2 and summary.rows_read == 120


def test_heatmap_downsampled_to_bounded_columns(tmp_path):
    write_synthetic_dataset(tmp_path / "ds", 1, 1200, 8, spike_step=600, growing=0)
    result = analyze(tmp_path / "ds", stats=["norm"])
    hm = result.heatmaps[("grad_reduced", "norm")]
    assert hm.shape == (8, 1200)
    shown, width = trainermon.analysis.downsample(hm, 500, "max")
    assert width == 3 and shown.shape == (8, 400)
    assert (shown[600] == hm[600]).all()  # the spike survives binning by max
    fig = result.figures(max_columns=500)["heatmap_grad_reduced_norm"]
    assert "[1200 steps shown as 400 columns]" in fig.axes[0].get_title()
    assert fig.axes[0].get_xlabel() == "step (bins of 3 steps, max per bin)"
    paths = write_analysis_report(result, tmp_path / "rep", max_columns=500)
    _check_png(paths["png"]["heatmap_grad_reduced_norm"])


# ---- CLI and progress ----------------------------------------------------------------------------------
def test_cli_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a report written by mistake would land here, not in the repository
    assert main(["analyze", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["analyze", str(tmp_path / "empty")]) == 2
    assert "no monitor output" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "empty"), str(tmp_path / "missing")]) == 2
    write_synthetic_dataset(tmp_path / "ds", 1, 5, 3)
    assert main(["analyze", str(tmp_path / "ds"), "--family", "actv"]) == 2
    assert "not in" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "ds"), "--stat", "median"]) == 2
    assert "unknown statistics" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "ds"), "--steps", "100-200"]) == 2
    assert "no rows in" in (err := capsys.readouterr().err) and "for --steps 100-200" in err, err
    ds = str(tmp_path / "ds")
    # a step range that selects nothing is said as such, not as a statistic missing from both runs
    assert main(["compare", ds, ds, "--steps", "100-200"]) == 2
    err = capsys.readouterr().err
    assert "steps 100-200 select no row of the run or the benchmark" in err, err
    assert main(["compare", ds, ds, "--stat", "median"]) == 2
    assert "unknown statistics ['median']; allowed: ['norm'" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ds", "empty"]


def test_a_statistic_the_run_did_not_record_is_said(tmp_path, out_dir, capsys):
    """`--stat mean` on a run recorded with ops norm, min: exit 2 naming it (it was an empty report
    and exit 0); next to a recorded one, a note."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(
        write_config(
            tmp_path / "c.json", wg_distribution=True, ops=["norm", "min"], format=["csv", "parquet"]
        )
    )
    monitor.set_monitor(model, optimizer=opt)
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
    monitor.close()
    for fmt, engine in (("csv", "pyarrow"), ("parquet", "pyarrow"), ("parquet", "duckdb")):
        common = [str(out_dir), "--format", fmt, "--engine", engine, "--out", str(tmp_path / "rep")]
        assert main(["analyze", *common, "--stat", "mean"]) == 2, (fmt, engine)
        assert "statistics ['mean'] are not recorded" in capsys.readouterr().err
        assert main(["analyze", *common, "--stat", "norm,mean"]) == 0, (fmt, engine)
        assert "note: statistics ['mean'] are not recorded" in capsys.readouterr().out


def test_progress_bar_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    stream = io.StringIO()
    bar = Progress(10, "scan", enabled=True, stream=stream, min_interval=0)
    bar.advance(5)
    bar.close()
    assert "50.0%" in stream.getvalue() and "100.0%" in stream.getvalue()
    quiet = io.StringIO()
    Progress(10, "scan", stream=quiet).advance(10)  # a StringIO is no terminal
    assert quiet.getvalue() == ""
    write_synthetic_dataset(tmp_path / "ds", 2, 5, 3)
    scan(tmp_path / "ds", progress=True, label="analyze")
    assert "analyze [" in capsys.readouterr().err
