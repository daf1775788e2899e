"""`analyze` and `compare` on the family columns (`update`: ratio, `moe_load`: load_cv) on every engine."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import trainermon
from tests.helpers import read_family, write_config
from tests.sinks.analysis_engines_common import BUMP_STEP, _with_output_dir
from tests.sinks.analysis_engines_common import runs as runs
from trainermon import TrainerMon
from trainermon.analysis import analyze, compare, open_run
from trainermon.cli import main

# `analyze` and `compare` on the family columns (`update`: ratio, `moe_load`: load_cv) through every
# engine: DuckDB (the default for Parquet) failed with `error: ratio` because its SQL looked the rule up in
# the statistics table, which has neither column. Real monitored runs (CSV and Parquet at once) are read by
# pyarrow (Parquet and CSV), DuckDB and Spark (when pyspark and a Java runtime are here); every engine must
# give the numbers the test computes from the rows themselves. CSV holds 6 significant digits: its values
# are checked to 1e-5, the Parquet engines' to 1e-12 (engines sum in their own order).
#
# Also the messages for a run id, a family or a rank that is not there (they must name it and list what
# is there, not say "no monitor output" or return an empty table).

RTOL = 0.01
SPARK_MASTER = "local[2]"


def _engines() -> list[str]:
    import importlib.util

    found = ["pyarrow"]
    if importlib.util.find_spec("duckdb") is not None:
        found.append("duckdb")
    if importlib.util.find_spec("pyspark") is not None and shutil.which("java") is not None:
        found.append("spark")
    return found


ENGINES = _engines()
# (format read, engine): the Parquet dataset through every engine, and the CSV files (pyarrow only)
READERS = [("parquet", e) for e in ENGINES] + [("csv", "pyarrow")]


def _train_moe(out: Path, seed: int) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = write_config(
        out.parent / f"{out.name}.json",
        moe_distribution=True,
        update_distribution=True,
        ops=["norm", "mean", "min", "max", "zeros", "numel"],
        format=["csv", "parquet"],
    )
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )

    def run() -> None:
        torch.manual_seed(0)
        model = MixtralForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt, grad_acc_steps=2)
        gen = torch.Generator().manual_seed(seed)
        for _step in range(3):
            for _micro in range(2):
                ids = torch.randint(0, 64, (2, 12), generator=gen)
                model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        mon.close()

    _with_output_dir(out, run)
    return out


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("moe_runs")
    return {"run": _train_moe(root / "run", 1), "bench": _train_moe(root / "bench", 2)}


@pytest.fixture(scope="module")
def spark_master():
    if "spark" not in ENGINES:
        yield None
        return
    from trainermon.analysis import engines

    engines.session("spark", SPARK_MASTER)  # one session for the module (a new one takes seconds)
    yield SPARK_MASTER
    engines.stop_spark()


# ---- the rows themselves -------------------------------------------------------------------------
def _rows(out: Path, fmt: str, family: str, column: str) -> dict[tuple[str, int], float]:
    """{(name, step): value} of one family column, read back without the analysis code."""
    if fmt == "parquet":
        table = trainermon.load(out, family=family, columns=["name", "step", "micro_step", column])
        items = table.to_pylist()
    else:
        (run_dir,) = [d for d in out.iterdir() if d.is_dir() and "-rank0-" in d.name]
        items = read_family(str(run_dir), family)
    got: dict[tuple[str, int], float] = {}
    for r in items:
        assert r.get("micro_step") in (None, ""), r  # one row per (tensor, step): no micro-steps
        key = (r["name"], int(r["step"]))
        assert key not in got, f"two rows for {key}"
        got[key] = float(r[column])
    assert got and len({n for n, _ in got}) > 1
    return got


def _matrix(rows: dict[tuple[str, int], float]) -> pd.DataFrame:
    names = list(dict.fromkeys(n for n, _ in rows))  # first appearance: the model order
    steps = sorted({s for _, s in rows})
    return pd.DataFrame(
        [[rows.get((n, s), np.nan) for s in steps] for n in names], index=names, columns=steps
    )


def _same(got: pd.DataFrame, want: pd.DataFrame, rtol: float) -> None:
    assert list(got.index) == list(want.index) and list(got.columns) == list(want.columns)
    a, b = got.to_numpy(np.float64), want.to_numpy(np.float64)
    assert np.array_equal(np.isfinite(a), np.isfinite(b)) and np.array_equal(np.isinf(a), np.isinf(b))
    ok = np.isfinite(b)
    np.testing.assert_allclose(a[ok], b[ok], rtol=rtol, atol=0)


def _source(out: Path, fmt: str):
    return open_run(out, prefer=fmt)


def _expected_comparison(run: pd.DataFrame, bench: pd.DataFrame) -> tuple[int, int, tuple[int, str]]:
    """(cells compared, cells diverging, first (step, name)) by compare's documented rule: relative
    difference above RTOL, or one side non-finite and the other not."""
    a, b = run.to_numpy(np.float64), bench.loc[run.index, run.columns].to_numpy(np.float64)
    here = ~np.isnan(a) | ~np.isnan(b)
    bad_a, bad_b = ~np.isfinite(a), ~np.isfinite(b)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
    div = here & ((bad_a != bad_b) | (~bad_a & ~bad_b & (rel > RTOL)))
    j = int(np.argmax(div.any(axis=0)))
    i = int(np.argmax(div[:, j]))
    return int(here.sum()), int(div.sum()), (int(run.columns[j]), str(run.index[i]))


# ---- update: analyze and compare through every engine ---------------------------------------------
@pytest.mark.parametrize("fmt,engine", READERS)
def test_update_ratio_same_on_every_engine(runs, fmt, engine, spark_master):
    want = _matrix(_rows(runs["run"], fmt, "update", "ratio"))
    assert np.isinf(want.loc["final_norm.bias", 0])  # w_before = 0: the first ratio is Inf
    result = analyze(_source(runs["run"], fmt), engine=engine, spark_master=spark_master, progress=False)
    rtol = 1e-5 if fmt == "csv" else 1e-12
    _same(result.heatmaps[("update", "ratio")], want, rtol)
    # first non-finite: the Inf ratio at step 0 (nothing else is non-finite in this run)
    first = result.first_nonfinite.iloc[0]
    assert (first["family"], first["name"], int(first["step"])) == ("update", "final_norm.bias", 0)
    assert result.summary.nonfinite_counts.get("update") == int((~np.isfinite(want.to_numpy())).sum())
    assert result.engine == engine

    cmp = compare(
        _source(runs["run"], fmt),
        _source(runs["bench"], fmt),
        stats=["ratio"],
        families=["update"],
        rtol=RTOL,
        engine=engine,
        spark_master=spark_master,
        progress=False,
    )
    bench = _matrix(_rows(runs["bench"], fmt, "update", "ratio"))
    cells, diverging, (step, name) = _expected_comparison(want, bench)
    assert (step, name) == (BUMP_STEP, "layers.1.weight")
    row = cmp.per_family.set_index("family").loc["update"]
    assert (int(row["cells_compared"]), int(row["cells_divergent"])) == (cells, diverging)
    assert (cmp.first.family, cmp.first.stat, cmp.first.step, cmp.first.name) == (
        "update",
        "ratio",
        step,
        name,
    )
    assert math.isclose(cmp.first.run_value, want.loc[name, step], rel_tol=rtol)
    assert math.isclose(cmp.first.benchmark_value, bench.loc[name, step], rel_tol=rtol)


def _findings(path: Path) -> dict:
    data = json.loads(path.read_text())
    data.pop("engine", None)
    for side in ("run", "benchmark"):
        if isinstance(data.get(side), dict):
            data[side].pop("seconds", None)
    return data


def test_cli_update_family_on_every_engine(runs, spark_master, tmp_path, capsys):
    """The reviewer's commands: `analyze --family update` and `compare --stat ratio` (exit 1: the
    benchmark diverges), the same findings.json from every engine."""
    run, bench = str(runs["run"]), str(runs["bench"])
    analyses, comparisons = {}, {}
    for engine in ENGINES:
        extra = ["--engine", engine] + (["--spark-master", spark_master] if engine == "spark" else [])
        out = tmp_path / f"a_{engine}"
        code = main(["analyze", run, "--family", "update", "--out", str(out), *extra])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert "first NaN/Inf: step 0 update final_norm.bias" in captured.out
        analyses[engine] = _findings(out / "findings.json")
        out = tmp_path / f"c_{engine}"
        code = main(
            ["compare", run, bench, "--stat", "ratio", "--family", "update", "--out", str(out), *extra]
        )
        captured = capsys.readouterr()
        assert code == 1, captured.err
        assert f"first divergence: step {BUMP_STEP} update layers.1.weight ratio" in captured.out
        comparisons[engine] = _findings(out / "compare.json")
    assert {h["stat"] for h in analyses["pyarrow"]["heatmaps"]} >= {"norm", "ratio"}
    for engine in ENGINES[1:]:
        assert analyses[engine] == analyses["pyarrow"], engine
        assert comparisons[engine] == comparisons["pyarrow"], engine


# ---- moe_load: load_cv ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,engine", READERS)
def test_moe_load_cv_same_on_every_engine(moe_runs, fmt, engine, spark_master):
    want = _matrix(_rows(moe_runs["run"], fmt, "moe_load", "load_cv"))
    ratio = _matrix(_rows(moe_runs["run"], fmt, "update", "ratio"))
    result = analyze(
        _source(moe_runs["run"], fmt),
        families=["moe_load", "update"],
        engine=engine,
        spark_master=spark_master,
        progress=False,
    )
    rtol = 1e-5 if fmt == "csv" else 1e-12
    # names as the analysis shows them: leading `module.` segments only are dropped (none here)
    _same(result.heatmaps[("moe_load", "load_cv")], want, rtol)
    _same(result.heatmaps[("update", "ratio")], ratio, rtol)
    cmp = compare(
        _source(moe_runs["run"], fmt),
        _source(moe_runs["bench"], fmt),
        stats=["load_cv"],
        families=["moe_load"],
        rtol=RTOL,
        engine=engine,
        spark_master=spark_master,
        progress=False,
    )
    bench = _matrix(_rows(moe_runs["bench"], fmt, "moe_load", "load_cv"))
    cells, diverging, (step, name) = _expected_comparison(want, bench)
    row = cmp.per_family.set_index("family").loc["moe_load"]
    assert (int(row["cells_compared"]), int(row["cells_divergent"])) == (cells, diverging)
    assert diverging > 0 and (cmp.first.step, cmp.first.name, cmp.first.stat) == (step, name, "load_cv")
