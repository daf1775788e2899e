"""Offline-analysis fixes from the audit: a rank that starts like another but differs later is read (not
taken for a copy), the cross-rank mean is weighted by finite elements, the cross-rank first NaN follows
model order, actv_grad has one layer order in CSV and Parquet, and csv2tensorboard_by_step converts SGD's
momentum_buffer. Values are checked against pandas references computed here from the files written."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from tests.helpers import write_config
from trainermon import TrainerMon
from trainermon.analysis import analyze
from trainermon.convert import convert

ACTV = "vpp_stage,name,step,micro_step,norm,min,max,mean,nans,infs,shape,dtype"
NAMES = ("layers.0.input", "layers.0.output", "head.output")


def _write(path: Path, header: str, rows: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "\n" + "\n".join(rows) + "\n")


def _raw(root: Path, family: str) -> pd.DataFrame:
    """Every rank's CSV rows of `family`, with the rank (the reference's input)."""
    frames = []
    for d in sorted(os.listdir(root)):
        for f in sorted((root / d).glob(f"{family}_[0-9]*.csv")):
            frames.append(pd.read_csv(f).assign(rank=int(d.split("-rank")[1].split("-")[0])))
    return pd.concat(frames, ignore_index=True)


def _engines(root: Path, tmp: Path) -> list[tuple[str, Path, str]]:
    pq = tmp / "pq"
    if not pq.exists():
        convert(root, pq)
    out = [("csv", root, "pyarrow"), ("parquet", pq, "pyarrow")]
    try:
        import duckdb  # noqa: F401

        out.append(("duckdb", pq, "duckdb"))
    except ImportError:
        pass
    return out


def _actv_run(root: Path, steps: int, late_nan: int | None, nan_count: int = 1) -> None:
    """Two ranks with the same actv rows (replicated data) except rank 1 at step `late_nan`: a NaN in
    layers.0.output (`nan_count` of its 32 elements, mean/norm of the rest). grad_reduced equal on both
    ranks over the whole run (a true copy)."""
    rng = np.random.default_rng(0)
    vals = rng.normal(1.0, 0.3, (steps, len(NAMES), 4)).tolist()  # floats: repr() writes the number
    for rank in (0, 1):
        rows, grads = [], []
        for s in range(steps):
            for t, name in enumerate(NAMES):
                norm, lo, hi, mean = vals[s][t]
                nans = 0
                if rank == 1 and s == late_nan and name == "layers.0.output":
                    norm, lo, hi, mean, nans = norm * 0.5, lo - 1, hi, mean - 0.75, nan_count
                rows.append(f'0,{name},{s},0,{norm!r},{lo!r},{hi!r},{mean!r},{nans},0,"[4, 8]",torch.float32')
            grads.append(f'0,layers.0.weight,{s},{vals[s][0][0]!r},0,0,"[8, 8]",torch.float32')
        run = root / f"Jan01_00-00-00-rank{rank}-abc"
        _write(run / f"actv_0-{steps - 1}.csv", ACTV, rows)
        _write(
            run / f"grad_reduced_0-{steps - 1}.csv", "vpp_stage,name,step,norm,nans,infs,shape,dtype", grads
        )


def test_rank_equal_at_first_and_different_later_is_read(tmp_path):
    """Over 256 identical leading rows (the old fingerprint's window), then a NaN on rank 1 only: the old
    scan skipped rank 1's actv for the whole run (first NaN, cell norms lost)."""
    root = tmp_path / "csv"
    _actv_run(root, steps=100, late_nan=95)  # 285 identical rows before the difference
    raw = _raw(root, "actv")
    bad = raw[raw.nans > 0].sort_values("step", kind="stable").iloc[0]
    cell = raw[(raw.name == "layers.0.output") & (raw.step == 95)]
    want_norm = math.sqrt(float((cell.norm**2).sum()))  # two different rows: both pieces count
    same = raw[(raw.name == "layers.0.output") & (raw.step == 94)]
    assert len(same.drop_duplicates(["norm", "min", "max", "mean"])) == 1  # copies: counted once
    for label, src, engine in _engines(root, tmp_path):
        res = analyze(src, engine=engine, progress=False)
        assert len(res.first_nonfinite), (label, "rank 1's NaN was not read")
        first = res.first_nonfinite.iloc[0]
        assert (first.family, first["name"], int(first.step), int(first["rank"])) == (
            "actv",
            bad["name"],
            int(bad.step),
            int(bad["rank"]),
        ), label
        norm = res.heatmaps[("actv", "norm")]
        assert norm.loc["layers.0.output", 95] == pytest.approx(want_norm, rel=1e-12), label
        assert norm.loc["layers.0.output", 94] == pytest.approx(float(same.norm.iloc[0]), rel=1e-12), label
        assert res.heatmaps[("actv", "min")].loc["layers.0.output", 95] == cell["min"].min(), label
        # a rank whose rows all copy an earlier rank's is still counted once (read, not folded)
        assert res.summary.copies == {("grad_reduced", 1): 0}, (label, res.summary.copies)


def test_cross_rank_mean_is_weighted_by_finite_elements(tmp_path):
    """numel 32 per rank, 8 NaN on rank 1: the cell mean is sum(mean * finite) / sum(finite), as the
    online combine (stats.table.combine); it was weighted by numel."""
    root = tmp_path / "csv"
    _actv_run(root, steps=4, late_nan=2, nan_count=8)
    raw = _raw(root, "actv")
    raw["finite"] = 32 - raw.nans - raw.infs
    cell = raw[(raw.name == "layers.0.output") & (raw.step == 2)]
    want = float((cell["mean"] * cell.finite).sum() / cell.finite.sum())
    by_numel = float(cell["mean"].mean())
    assert abs(want - by_numel) > 1e-3 * abs(want)  # the two rules tell apart here
    for label, src, engine in _engines(root, tmp_path):
        mean = analyze(src, engine=engine, progress=False).heatmaps[("actv", "mean")]
        assert mean.loc["layers.0.output", 2] == pytest.approx(want, rel=1e-12), label
        copies = raw[(raw.name == "layers.0.output") & (raw.step == 1)]  # equal rows: one tensor
        assert mean.loc["layers.0.output", 1] == pytest.approx(float(copies["mean"].iloc[0]), rel=1e-12), (
            label
        )


XRANK = (
    "vpp_stage,name,step,micro_step,family,stat,max,min,mean,max_rank,min_rank,nans,infs,nonfinite_rank,ranks"
)


def test_cross_rank_first_nonfinite_follows_model_order(tmp_path):
    """Two tensors with a NaN at the same step: layers.2.input runs before head.input (actv rows in that
    order), but the name sorts after: the finding named head.input."""
    run = tmp_path / "csv" / "Jan01_00-00-00-rank0-abc"
    order = ["layers.2.input", "layers.2.output", "head.input", "head.output"]
    rows, xr = [], []
    for s in range(3):
        for name in order:
            nans = int(s == 2 and name in ("layers.2.input", "head.input"))
            rows.append(f'0,{name},{s},0,1.5,-1,1,0.1,{nans},0,"[4, 8]",torch.float32')
            xr.append(f"0,{name},{s},0,actv,norm,1.5,1.2,1.3,0,1,{nans},0,{1 if nans else -1},2")
    _write(run / "actv_0-2.csv", ACTV, rows)
    _write(run / "xrank_0-2.csv", XRANK, xr)
    raw = pd.read_csv(run / "xrank_0-2.csv")
    bad = raw[raw.nonfinite_rank >= 0]
    want = bad[bad.step == bad.step.min()].iloc[0]  # rows in hook (model) order: the first one
    for label, src, engine in _engines(tmp_path / "csv", tmp_path):
        found = analyze(src, engine=engine, progress=False).xrank["first_nonfinite"]
        assert (found["name"], found["step"], found["rank"]) == (want["name"], 2, 1), label
        assert [r["name"] for r in found["rows"]] == list(bad[bad.step == 2]["name"]), label


def test_actv_grad_order_is_the_same_in_csv_and_parquet(tmp_path):
    """The CSV exporter writes actv_grad in msprobe's order (a module's input, then its output); Parquet
    keeps the arrival order (outputs first). analyze showed two layer orders for one run."""
    root = tmp_path / "csv"
    run = root / "Jan01_00-00-00-rank0-abc"
    modules = ["head", "layers.1", "layers.0"]  # backward order
    csv_rows = [
        f'0,{m}.{io},{s},0,{1.0 + i},-1,1,0.1,0,0,"[4, 8]",torch.float32'
        for s in range(2)
        for i, m in enumerate(modules)
        for io in ("input", "output")
    ]
    _write(run / "actv_grad_0-1.csv", ACTV, csv_rows)
    convert(root, tmp_path / "pq")
    import pyarrow.parquet as pq

    # the sink's arrival order: each module's output gradient before its input gradient
    for part in (tmp_path / "pq").rglob("*.parquet"):
        table = pq.read_table(part)
        names = table.column("name").to_pylist()
        swapped = [i + 1 if n.endswith(".input") else i - 1 for i, n in enumerate(names)]
        pq.write_table(table.take(swapped), part)
    stored = pd.read_parquet(next((tmp_path / "pq").rglob("*.parquet")))
    assert stored["name"].iloc[0] == "head.output"
    want = list(dict.fromkeys(pd.read_csv(run / "actv_grad_0-1.csv")["name"]))
    got = {}
    for label, src, engine in _engines(root, tmp_path):
        got[label] = list(analyze(src, engine=engine, progress=False).heatmaps[("actv_grad", "norm")].index)
        assert got[label] == want, (label, got[label])


def test_csv2tensorboard_converts_sgd_momentum(tmp_path, out_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainermon import csv2tensorboard_by_step

    cfg = write_config(tmp_path / "c.json", mv_distribution=True, ops=["norm", "max"], ndigits=12)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    for _ in range(3):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    raw = pd.concat(pd.read_csv(f) for f in Path(monitor.run_dir).glob("momentum_buffer_*.csv"))
    assert len(raw)
    for i, families in enumerate((None, ["momentum_buffer"])):
        out = csv2tensorboard_by_step(
            str(out_dir), data_type_list=families, output_dirpath=str(tmp_path / f"o{i}")
        )
        acc = EventAccumulator(os.path.join(out, "rank0", "momentum_buffer"), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        for r in raw.itertuples(index=False):
            tag = next(t for t in tags if t.endswith(f":{r.name}/norm"))
            got = {e.step: e.value for e in acc.Scalars(tag)}
            assert got[r.step] == pytest.approx(r.norm, rel=1e-6)  # float32 in the event file


@pytest.mark.parametrize("value", ["zero", "0", "-2", "1.5"])
def test_duckdb_threads_variable_is_checked(monkeypatch, value):
    """A bad TRAINERMON_DUCKDB_THREADS is an error naming the variable, the value and what is allowed
    (was a bare int() ValueError, or a DuckDB error for 0)."""
    pytest.importorskip("duckdb")
    from trainermon.analysis.engines import _DuckDB

    monkeypatch.setenv("TRAINERMON_DUCKDB_THREADS", value)
    with pytest.raises(ValueError, match=f"TRAINERMON_DUCKDB_THREADS='{value}'.*positive integer"):
        _DuckDB()
    monkeypatch.setenv("TRAINERMON_DUCKDB_THREADS", "1")
    assert _DuckDB().con.execute("SELECT current_setting('threads')").fetchone()[0] == 1
