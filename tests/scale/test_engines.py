"""Offline analysis on every engine (pyarrow, DuckDB, Spark in local mode): the Parquet output of one real
4-rank job (gloo, DDP, a NaN injected into rank 3's input at step 2) gives the same findings from each
engine, and those findings equal what this test computes from the raw rows; `compare` finds the same
first divergence on each engine, the one the test planted in a copy of the run.

Floats from different engines can differ in their last bits (the engines sum a cell's rows in their own
order): a sum of n terms in any order is within n * 2^-52 of another order, relative, for the positive
squares of a norm; with n < 100 here, 1e-12 bounds it with room. Everything else (steps, names, ranks,
counts, spike steps, orders) must be equal. Spark needs a Java runtime: installed with apt-get when
missing (as the Prometheus end-to-end test does); without apt-get or root the module fails saying so.
One Spark session serves the whole module (starting one takes seconds). pyspark is an optional extra that
`make` installs in a step of its own (a 456 MB download): without it the other engines are still compared
and `test_spark_engine_checked` is reported as skipped, saying Spark was not checked."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from trainermon.collect.records import FAMILIES

WORLD, STEPS = 4, 4
NAN_RANK, NAN_STEP = 3, 2
PLANT_STEP, PLANT_FACTOR = 1, 1.5
SPARK_MASTER = "local[2]"
HAVE_PYSPARK = importlib.util.find_spec("pyspark") is not None
ENGINES = ("pyarrow", "duckdb") + (("spark",) if HAVE_PYSPARK else ())
RTOL = 1e-12


def _job(rank: int, world: int, out: str) -> None:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out, f"config-rank{rank}.json")
    os.makedirs(out, exist_ok=True)
    with open(cfg, "w") as fh:
        json.dump(
            {
                "xy_distribution": True,
                "wg_distribution": True,
                "mv_distribution": True,
                "ops": ["norm", "mean", "min", "max", "nans", "infs"],
                "format": ["parquet"],
                "write_interval_s": 0,
            },
            fh,
        )
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(10 + rank)
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=gen)
        if rank == NAN_RANK and step == NAN_STEP:
            x[0, 0] = float("nan")  # rank 3's activations and pre-reduce gradients go non-finite
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()


def _ensure_java() -> None:
    if shutil.which("java") is not None:
        return
    if shutil.which("apt-get") is None:
        pytest.fail(
            "the Spark engine test needs a Java runtime, which is missing, and apt-get is not available"
        )
    if os.geteuid() != 0:
        pytest.fail("no Java runtime for Spark, and installing one with apt-get needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", "openjdk-17-jre-headless"],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    if shutil.which("java") is None:
        pytest.fail("apt-get installed openjdk-17-jre-headless but `java` is not on PATH")


@pytest.fixture(scope="module")
def spark():
    from trainermon.analysis import engines

    if not HAVE_PYSPARK:
        yield None  # the tests compare the other engines; test_spark_engine_checked says Spark was not
        return
    _ensure_java()
    engines.session("spark", SPARK_MASTER)  # started once for the module
    yield SPARK_MASTER
    engines.stop_spark()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(run dataset, benchmark dataset: a copy with one grad_reduced norm scaled at PLANT_STEP, and the
    planted (name, run value, benchmark value))."""
    base = tmp_path_factory.mktemp("engines")
    out = str(base / "out")
    run_ranks(_job, world_size=WORLD, timeout=300, out=out)
    run = os.path.join(out, "parquet")
    bench = str(base / "bench")
    shutil.copytree(run, bench)
    # the planted divergence: the first grad_reduced tensor of the first file holding PLANT_STEP
    target = None
    for directory, _dirs, files in sorted(os.walk(os.path.join(bench, "family=grad_reduced"))):
        for name in sorted(f for f in files if f.startswith("part-")):
            path = os.path.join(directory, name)
            table = pq.read_table(path)
            hit = np.flatnonzero(table.column("step").to_numpy() == PLANT_STEP)
            if target is None and hit.size:
                i = int(hit[0])
                norm = table.column("norm").to_numpy().copy()
                planted = (table.column("name")[i].as_py(), float(norm[i]), float(norm[i] * PLANT_FACTOR))
                norm[i] *= PLANT_FACTOR
                table = table.set_column(
                    table.schema.get_field_index("norm"), "norm", pc.cast(norm, "double")
                )
                pq.write_table(table, path)
                target = planted
    assert target is not None, "the run has no grad_reduced row at the planted step"
    return run, bench, target


def _close(a, b, path: str = "") -> None:
    """Structures equal; floats within RTOL relative (NaN equals NaN); "nan"/"inf" strings exactly."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, sorted(a), sorted(b))
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (path, len(a), len(b) if isinstance(b, list) else b)
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool) and isinstance(b, (int, float)):
        # a relative difference of two cells equal up to rounding is itself rounding (~1e-16): absolute
        tiny = 1e-12 if "rel_diff" in path else 1e-300
        both_nan = math.isnan(a) and math.isnan(b)
        assert both_nan or math.isclose(a, b, rel_tol=RTOL, abs_tol=tiny), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _findings(result) -> dict:
    f = result.findings()
    f["run"].pop("seconds")
    f.pop("engine")
    return f


def _raw(run: str) -> dict:
    """The dataset's rows, read independently of trainermon.analysis."""
    table = ds.dataset(run, format="parquet", partitioning="hive").to_table()
    return {c: table.column(c).to_pylist() for c in table.column_names}


def test_every_engine_same_findings(runs, spark):
    from trainermon.analysis import analyze

    run, _bench, _target = runs
    results = {e: analyze(run, engine=e, spark_master=spark, progress=False) for e in ENGINES}
    found = {e: _findings(r) for e, r in results.items()}
    for e in ENGINES[1:]:
        _close(found["pyarrow"], found[e], e)
        assert results[e].engine == e
        # a URL (as s3://... would be): the engine lists and reads the dataset itself
        by_url = _findings(analyze("file://" + run, engine=e, spark_master=spark, progress=False))
        assert by_url["run"].pop("path") == "file://" + run
        found_local = json.loads(json.dumps(found["pyarrow"]))
        found_local["run"].pop("path")
        _close(found_local, by_url, f"{e} by URL")
    f = found["duckdb"]
    raw = _raw(run)
    n = len(raw["step"])
    rows = [{k: raw[k][i] for k in raw} for i in range(n)]
    assert f["run"]["rows_read"] == sum(1 for r in rows if r["family"] != "xrank")

    # first non-finite: at step 2, on rank 3, in the earliest family (hook order) with any, and the
    # tensor of that family that comes first in rank 0's rows of the first step (model order)
    def bad(r):
        vals = [r[s] for s in ("norm", "mean", "min", "max") if r[s] is not None]
        return any(not math.isfinite(v) for v in vals) or (r["nans"] or 0) > 0 or (r["infs"] or 0) > 0

    bad_rows = [r for r in rows if r["family"] != "xrank" and bad(r)]
    assert bad_rows and min(r["step"] for r in bad_rows) == NAN_STEP
    # at the NaN step only rank 3's own rows are non-finite (the next step every rank's: NaN weights)
    per_rank = ("actv", "actv_grad", "grad_unreduced")
    at_nan = {r["rank"] for r in bad_rows if r["family"] in per_rank and r["step"] == NAN_STEP}
    assert at_nan == {NAN_RANK}
    first_fam = min({r["family"] for r in bad_rows if r["step"] == NAN_STEP}, key=FAMILIES.index)
    order = [r["name"] for r in rows if r["family"] == first_fam and r["rank"] == 0 and r["step"] == 0]
    at = [r for r in bad_rows if r["step"] == NAN_STEP and r["family"] == first_fam]
    micro = min((r["micro_step"] for r in at if r["micro_step"] is not None), default=None)
    at = [r for r in at if r["micro_step"] == micro]
    want = min(at, key=lambda r: (order.index(r["name"]), r["rank"]))
    got = f["first_nonfinite"]["first"]
    assert (got["step"], got["family"], got["name"], got["rank"]) == (
        NAN_STEP,
        first_fam,
        want["name"],
        NAN_RANK,
    )

    # global grad norm per step: sqrt of the sum of squares of every grad_reduced row's norm (DDP: the
    # reduced gradient is written once); NaN at the NaN step
    gr = [r for r in rows if r["family"] == "grad_reduced"]
    expect = {}
    for r in gr:
        expect[r["step"]] = expect.get(r["step"], 0.0) + r["norm"] ** 2
    nan_steps = {r["step"] for r in gr if bad(r)}
    assert min(nan_steps) == NAN_STEP and len(nan_steps) < len(expect)  # later steps: NaN weights
    gn = f["global_grad_norm"]
    assert gn["steps"] == sorted(expect)
    for step, value in zip(gn["steps"], gn["values"]):
        if step in nan_steps:
            assert value == "nan", step
        else:
            assert math.isclose(value, math.sqrt(expect[step]), rel_tol=1e-12), (step, value)

    # cross-rank summaries: the first non-finite rank, and the largest per-rank norm with its rank
    x = f["xrank"]
    assert (
        x is not None
        and x["first_nonfinite"]["rank"] == NAN_RANK
        and x["first_nonfinite"]["step"] == NAN_STEP
    )
    largest = {(d["family"], d["stat"]): d for d in x["largest"]}
    for fam in ("actv", "grad_unreduced"):
        mine = [r for r in rows if r["family"] == fam and r["norm"] is not None and math.isfinite(r["norm"])]
        top = max(mine, key=lambda r: (r["norm"], -r["step"], -r["rank"]))
        d = largest[(fam, "norm")]
        assert (d["name"], d["step"], d["max_rank"]) == (top["name"], top["step"], top["rank"]), (fam, d, top)
        assert math.isclose(d["max"], top["norm"], rel_tol=2.0**-49)
    # xrank rows are summaries, not tensors: no heatmap of them
    assert all(h["family"] != "xrank" for h in f["heatmaps"])


def test_every_engine_same_first_divergence(runs, spark):
    from trainermon.analysis import compare

    run, bench, (name, run_value, bench_value) = runs
    results = {e: compare(run, bench, engine=e, spark_master=spark, progress=False) for e in ENGINES}
    for e, c in results.items():
        first = c.first
        assert first is not None, e
        assert (first.family, first.name, first.step, first.stat) == (
            "grad_reduced",
            name,
            PLANT_STEP,
            "norm",
        ), e
        assert math.isclose(first.run_value, run_value, rel_tol=RTOL)
        assert math.isclose(first.benchmark_value, bench_value, rel_tol=RTOL)
        # the planted cell is the only divergence: NaN at step 2 is on both sides
        assert int(c.per_family["cells_divergent"].sum()) == 1, (e, c.per_family)
    base = results["pyarrow"].findings()
    for e in ENGINES[1:]:
        other = results[e].findings()
        for side in ("run", "benchmark"):
            base[side].pop("seconds", None)
            other[side].pop("seconds", None)
        _close(base, other, e)


def test_cli_engine_flags(runs, spark, tmp_path, capsys):
    from trainermon.cli import main

    run, bench, (name, _rv, _bv) = runs
    out = str(tmp_path / "report")
    # the default (auto): DuckDB for a Parquet dataset when it is installed (as `make venv` does)
    assert main(["analyze", run, "--out", out, "--no-progress"]) == 0
    with open(os.path.join(out, "findings.json")) as fh:
        findings = json.load(fh)
    assert findings["engine"] == "duckdb" and findings["first_nonfinite"]["first"]["rank"] == NAN_RANK
    printed = capsys.readouterr().out
    assert "(engine duckdb," in printed
    assert f"across ranks: first NaN/Inf at step {NAN_STEP} " in printed and f"on rank {NAN_RANK}" in printed
    with open(os.path.join(out, "report.html")) as fh:
        assert "<h2>Across ranks</h2>" in fh.read()
    flags = ["--engine", "spark", "--spark-master", spark] if spark else ["--engine", "pyarrow"]
    code = main(["compare", run, bench, *flags, "--out", str(tmp_path / "c")])
    assert code == 1  # diverged
    assert f"first divergence: step {PLANT_STEP} grad_reduced {name} norm" in capsys.readouterr().out


def test_engines_lazy_and_named_when_missing(runs, tmp_path):
    run = runs[0]
    code = (
        "import sys\n"
        "import trainermon.analysis, trainermon.cli\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('duckdb', 'pyspark')], 'imported early'\n"
        "sys.modules['duckdb'] = None\n"  # as if not installed
        "from trainermon.analysis import analyze\n"
        "try:\n"
        f"    analyze({run!r}, engine='duckdb')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "'duckdb'" in done.stdout and "pip install 'trainermon[duckdb]'" in done.stdout

    from trainermon.analysis import analyze

    allowed = r"engine: got 'sqlite'; allowed: \['auto', 'pyarrow', 'duckdb', 'spark'\]"
    with pytest.raises(ValueError, match=allowed):
        analyze(run, engine="sqlite")
    csv_dir = tmp_path / "csvrun" / "20260101-rank0-x"
    csv_dir.mkdir(parents=True)
    (csv_dir / "grad_reduced_0-0.csv").write_text("vpp_stage,name,step,norm\n0,w,0,1.0\n")
    with pytest.raises(ValueError, match="reads Parquet datasets.*trainermon convert"):
        analyze(str(tmp_path / "csvrun"), engine="duckdb")


def test_every_engine_counts_a_copied_rank_once(tmp_path, spark):
    """msprobe writes replicated tensors on every rank: a rank whose rows copy an earlier rank's counts
    once, on every engine (here rank 2's files are rank 1's)."""
    from trainermon.analysis import analyze
    from trainermon.analysis.synthetic import write_synthetic_dataset

    root = str(tmp_path / "ds")
    write_synthetic_dataset(root, 3, 30, 8, steps_per_part=10, spike_step=None, growing=0)
    mine, theirs = (os.path.join(root, "family=grad_reduced", f"rank={r}") for r in (2, 1))
    shutil.rmtree(mine)
    shutil.copytree(theirs, mine)
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    rank, step, norm = (table.column(c).to_numpy() for c in ("rank", "step", "norm"))
    keep = rank < 2  # the reference: ranks 0 and 1 only
    expect = np.sqrt(np.bincount(step[keep], weights=norm[keep] ** 2))
    found = {}
    for e in ENGINES:
        a = analyze(root, engine=e, spark_master=spark, progress=False)
        assert a.summary.copies == {("grad_reduced", 2): 1}, e
        assert any("grad_reduced rank 2 = rank 1" in n for n in a.summary.notes), e
        np.testing.assert_allclose(a.global_norm.to_numpy(), expect, rtol=RTOL)
        found[e] = _findings(a)
    for e in ENGINES[1:]:
        _close(found["pyarrow"], found[e], e)


def test_spark_engine_checked(spark):
    """Says, as a skip, when the Spark engine was left out of the comparisons above (pyspark missing)."""
    if spark is None:
        pytest.skip(
            "pyspark is not installed (make could not install the optional extra 'spark'; its output says "
            "why): the Spark engine was not checked"
        )
    from trainermon.analysis import engines

    assert "spark" in ENGINES
    # the module's one session is reused, not started again per scan
    assert engines.session("spark", spark).spark is engines.session("spark", spark).spark


def test_every_engine_reads_csv_steps_beside_the_dataset(tmp_path, out_dir, dynamic_mode, spark):
    """A dynamic run switched csv -> parquet -> csv (CSV steps 0-2 and 6-9, Parquet 3-5): every engine reads
    the 10 steps with the same findings (Spark refused the CSV steps' temporary parts, outside the dataset's
    basePath), and the temporary parts are removed once the analysis is dropped, not at exit."""
    import gc
    import glob

    import pandas as pd

    from tests.unit.dynamic_common import BASE, _train, _wait_dirty
    from trainermon.analysis import analyze
    from trainermon.runtime.control import update_config_file

    cfg = str(tmp_path / "cfg.json")
    with open(cfg, "w") as fh:
        json.dump({**BASE, "dynamic_on": True, "format": "csv", "write_interval_s": 0}, fh)

    def edit(**changes):
        return lambda monitor: (update_config_file(cfg, **changes), _wait_dirty(monitor))

    _train(cfg, 10, {2: edit(format="parquet"), 5: edit(format="csv", ops=["norm", "max"])})
    csv_rows = pd.concat([pd.read_csv(p) for p in glob.glob(f"{out_dir}/*-rank0-*/grad_reduced_*.csv")])
    pq_rows = ds.dataset(f"{out_dir}/parquet/family=grad_reduced").to_table(["step", "norm"]).to_pandas()
    rows = pd.concat([csv_rows[["step", "norm"]], pq_rows])
    assert sorted(set(csv_rows["step"])) == [0, 1, 2, 6, 7, 8, 9] and sorted(set(pq_rows["step"])) == [
        3,
        4,
        5,
    ]
    expect = np.sqrt((rows["norm"] ** 2).groupby(rows["step"]).sum().to_numpy())
    found, roots = {}, set()
    for e in ENGINES:
        a = analyze(str(out_dir), engine=e, spark_master=spark, progress=False)
        assert a.summary.source.kind == "parquet" and a.summary.source.csv_steps, e
        roots |= {p.path.rsplit("/family=", 1)[0] for p in a.summary.source.csv_steps}
        np.testing.assert_allclose(a.global_norm.to_numpy(), expect, rtol=RTOL)
        found[e] = _findings(a)
        assert found[e]["steps"] == {"first": 0, "last": 9, "count": 10}, e
        del a
        gc.collect()
    for e in ENGINES[1:]:
        _close(found["pyarrow"], found[e], e)
    assert len(roots) == len(ENGINES) and not [r for r in roots if os.path.exists(r)], roots
