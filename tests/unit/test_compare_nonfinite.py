"""`compare` on a cell non-finite on one side only: the divergence names the column that differs (a nans
count behind a finite norm), and `max_rel_diff` is inf, never the largest finite difference."""

from __future__ import annotations

import json
import math
from pathlib import Path

from trainermon.analysis import compare
from trainermon.cli import main

HEAD = "vpp_stage,name,step,norm,nans"


def _write(root: Path, rows: list[str]) -> None:
    d = root / "Jan01_00-00-00-rank0-r"
    d.mkdir(parents=True)
    (d / "grad_reduced_0-1.csv").write_text(HEAD + "\n" + "\n".join(rows) + "\n")


def test_nans_count_is_the_named_cause(tmp_path, capsys):
    # step 1: `a` has 3 NaNs in the run behind a norm within rtol (the norm skips them); `b` is 10 % off.
    _write(tmp_path / "run", ["0,a,0,1.0,0", "0,b,0,1.0,0", "0,a,1,2.001,3", "0,b,1,1.1,0"])
    _write(tmp_path / "bench", ["0,a,0,1.0,0", "0,b,0,1.0,0", "0,a,1,2.0,0", "0,b,1,1.0,0"])
    result = compare(tmp_path / "run", tmp_path / "bench", rtol=0.01)
    first = result.first
    assert (first.step, first.name, first.stat) == (1, "a", "nans")
    assert (first.run_value, first.benchmark_value, first.rel_diff) == (3.0, 0.0, math.inf)
    assert first.cause == "nans 0 -> 3"
    row = result.per_family.iloc[0]
    assert (row["cells_divergent"], row["cells_nonfinite"]) == (2, 1)
    assert row["max_rel_diff"] == math.inf  # not 0.1, the largest finite difference
    table = result.divergent.set_index("name")
    assert table.loc["b", "cause"] == "" and table.loc["b", "stat"] == "norm"
    assert abs(table.loc["b", "max_rel_diff"] - 0.1) < 1e-12  # |1.1 - 1| / 1, float64 rounding only
    code = main(["compare", str(tmp_path / "run"), str(tmp_path / "bench"), "--out", str(tmp_path / "o")])
    assert code == 1
    assert "grad_reduced a nans: run 3 benchmark 0 (rel. diff inf; nans 0 -> 3)" in capsys.readouterr().out
    found = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert found["first_divergence"]["cause"] == "nans 0 -> 3"
    assert found["per_family"][0]["max_rel_diff"] == "inf"


def test_a_nan_statistic_is_its_own_cause_and_finite_runs_keep_finite_max(tmp_path):
    _write(tmp_path / "run", ["0,a,0,1.0,0", "0,a,1,nan,0"])
    _write(tmp_path / "bench", ["0,a,0,1.05,0", "0,a,1,2.0,0"])
    result = compare(tmp_path / "run", tmp_path / "bench", rtol=0.1)
    first = result.first
    assert (first.step, first.stat, first.benchmark_value, first.cause) == (1, "norm", 2.0, "norm 2 -> nan")
    assert math.isnan(first.run_value) and result.per_family.loc[0, "max_rel_diff"] == math.inf
    finite = compare(tmp_path / "run", tmp_path / "bench", rtol=0.1, steps=(0, 0))
    assert finite.first is None and finite.per_family.loc[0, "cells_nonfinite"] == 0
    want = abs(1.0 - 1.05) / 1.05  # within rtol: compared, not divergent
    assert abs(finite.per_family.loc[0, "max_rel_diff"] - want) < 1e-15


def test_a_count_only_one_run_recorded_is_named(tmp_path, capsys):
    """The run's `ops` hold `nans`, the benchmark's do not: equal finite norms, 3 NaNs in the run. The
    divergence named the norm ('run 1 benchmark 1, rel. diff inf'); it names the count and its absence."""
    _write(tmp_path / "run", ["0,a,0,1.0,3"])
    d = tmp_path / "bench" / "Jan01_00-00-00-rank0-r"
    d.mkdir(parents=True)
    (d / "grad_reduced_0-1.csv").write_text("vpp_stage,name,step,norm\n0,a,0,1.0\n")
    first = compare(tmp_path / "run", tmp_path / "bench", rtol=0.01).first
    assert (first.stat, first.run_value, first.cause) == ("nans", 3.0, "nans (no column) -> 3")
    out = str(tmp_path / "o")
    assert main(["compare", str(tmp_path / "bench"), str(tmp_path / "run"), "--out", out]) == 1
    assert "a nans: run nan benchmark 3 (rel. diff inf; nans 3 -> (no column))" in capsys.readouterr().out
