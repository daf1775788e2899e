"""Offline analysis at scale (bounded memory, pushdown, downsampling), CLI errors, progress."""

from __future__ import annotations

import gc
import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import trainermon
from tests.helpers import write_config
from tests.sinks.analysis_common import _check_png
from trainermon import TrainerMon
from trainermon.analysis import (
    analyze,
    heatmap,
    open_run,
    scan,
)
from trainermon.analysis.progress import Progress
from trainermon.analysis.report import write_analysis_report
from trainermon.analysis.synthetic import write_synthetic_dataset
from trainermon.cli import main


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
