"""Offline analysis on real monitored runs: `trainermon compare` and `trainermon analyze`, msprobe CSV."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import LayeredNet, read_family, write_config
from tests.sinks.analysis_common import _check_png
from trainermon import TrainerMon
from trainermon.analysis import (
    analyze,
    compare,
    open_run,
)
from trainermon.analysis.report import write_analysis_report, write_comparison_report
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
