"""Parquet exporter: values against CSV, layout, parts and rolling, crash safety, config."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

import trainermon
from tests.sinks.parquet_common import FULL_OPS, full_config, run_monitored
from trainermon import ConfigError, TrainerMon, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_id_of(mon: TrainerMon) -> str:
    return os.path.basename(mon.run_dir).rsplit("-", 1)[-1]


def read_csv_rows(run_dir: str) -> dict[tuple, dict[str, str]]:
    rows = {}
    for path in glob.glob(os.path.join(run_dir, "*.csv")):
        family = os.path.basename(path).rsplit("_", 1)[0]
        with open(path, newline="") as fh:
            for r in csv.DictReader(fh):
                micro = int(r["micro_step"]) if "micro_step" in r else None
                key = (family, int(r["vpp_stage"]), r["name"], int(r["step"]), micro)
                assert key not in rows
                rows[key] = r
    return rows


def test_round_trip_equals_csv(tmp_path, monkeypatch):
    mon = run_monitored(
        tmp_path,
        full_config(parquet={"steps_per_part": 2}, update_distribution=True),
        steps=5,
        monkeypatch=monkeypatch,
    )
    mon.close()
    csv_rows = read_csv_rows(mon.run_dir)
    table = trainermon.load(tmp_path / "out")
    assert table.column_names == [
        "run_id", "rank", "family", "vpp_stage", "name", "step", "micro_step",
        "norm", "mean", "min", "max", "zeros", "nans", "infs", "numel", "shape", "dtype", "shard", "skipped",
        "calls", "bytes", "xrank_family", "xrank_stat", "max_rank", "min_rank", "nonfinite_rank", "ranks",
        "ratio", "load_cv", "max_expert", "min_expert", "dropped", "aux_loss", "expert_load",
        "max_head", "head_max_logit", "own_skip",
    ]  # fmt: skip
    assert table.num_rows == len(csv_rows) > 100
    assert set(table.column("family").to_pylist()) == {
        "actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "exp_avg", "exp_avg_sq",
        "param_updated", "update",
    }  # fmt: skip
    for r in table.to_pylist():
        key = (r["family"], r["vpp_stage"], r["name"], r["step"], r["micro_step"])
        c = csv_rows[key]
        assert r["run_id"] == run_id_of(mon) and r["rank"] == 0
        for stat in ("norm", "mean", "min", "max", "zeros"):
            assert r[stat] == float(c[stat]) or (math.isnan(r[stat]) and c[stat] == "nan"), (key, stat)
        for stat in ("nans", "infs", "numel"):
            assert r[stat] == int(c[stat])
        assert str(r["shape"]) == c["shape"] and r["dtype"] == c["dtype"]
        assert r["shard"] is None and c["shard"] == ""  # whole tensors: no piece label
        if r["family"] == "update":  # the update's ||dw||/||w||, last column of both
            assert r["ratio"] == float(c["ratio"]) and r["ratio"] > 0, key
        else:
            assert r["ratio"] is None and "ratio" not in c, key
    norms = trainermon.load(tmp_path / "out", family="param_updated", names="head.weight", steps=4)
    assert norms.num_rows == 1
    assert norms.column("shape").to_pylist() == [[3, 8]]


def test_metadata_layout_and_rolling(tmp_path, monkeypatch):
    cfg = full_config(format=["parquet"], ops=["norm", "max"], parquet={"steps_per_part": 2})
    mon = run_monitored(tmp_path, cfg, steps=5, monkeypatch=monkeypatch)
    mon.close()
    root = tmp_path / "out" / "parquet"
    assert (root / "_trainermon_dataset.json").is_file()
    parts = sorted(glob.glob(str(root / "family=grad_reduced" / "rank=0" / "*.parquet")))
    # 5 steps rolled every 2 steps: [0-1], [2-3], [4] (the last completed by close()).
    spans = [os.path.basename(p).split("-")[1:3] for p in parts]
    assert [(int(a), int(b)) for a, b in spans] == [(0, 1), (2, 3), (4, 4)]
    assert not glob.glob(str(root / "**" / ".*"), recursive=True)  # no temporary file left
    pf = pq.ParquetFile(parts[0])
    assert pf.metadata.num_row_groups == 1
    assert pf.metadata.row_group(0).column(0).compression == "ZSTD"
    meta = pf.schema_arrow.metadata
    assert meta[b"trainermon.schema_version"] == b"1"
    assert meta[b"trainermon.version"] == trainermon.__version__.encode()
    assert json.loads(meta[b"trainermon.config"])["ops"] == ["norm", "max", "shape", "dtype"]
    assert json.loads(meta[b"trainermon.run"])["run_id"] == run_id_of(mon)
    assert meta[b"trainermon.family"] == b"grad_reduced"
    t = trainermon.load(root, family="grad_reduced")
    # Statistics not in ops are null, not invented; numel is always there.
    assert t.column("mean").null_count == t.num_rows and t.column("norm").null_count == 0
    assert t.column("micro_step").null_count == t.num_rows  # grad_reduced has no micro-batches
    actv = trainermon.load(root, family="actv")
    assert sorted(set(actv.column("micro_step").to_pylist())) == [0, 1]
    # The dataset is plain Hive Parquet: pyarrow and pandas read the root as one dataset.
    plain = ds.dataset(str(root), format="parquet", partitioning="hive").to_table()
    assert plain.num_rows == trainermon.load(root).num_rows
    # The run directory points at the dataset; loading it gives this run's rows.
    assert trainermon.load(mon.run_dir).num_rows == plain.num_rows


def test_rows_per_part_and_flush_completes_a_part(tmp_path, monkeypatch):
    cfg = full_config(format=["parquet"], parquet={"steps_per_part": 1000, "rows_per_part": 10})
    mon = run_monitored(tmp_path, cfg, steps=2, monkeypatch=monkeypatch)
    mon.flush()
    root = tmp_path / "out" / "parquet"
    # actv has 2 micro-batches x (3 modules x in/out) = 12 rows per step >= 10: a part per step.
    actv_parts = glob.glob(str(root / "family=actv" / "rank=0" / "*.parquet"))
    assert len(actv_parts) == 2
    # grad_reduced (6 rows per step) stayed buffered until flush(), which completed it.
    t = trainermon.load(root, family="grad_reduced")
    assert sorted(set(t.column("step").to_pylist())) == [0, 1]
    assert t.num_rows == 12
    mon.close()


KILL_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    from torch import nn
    from trainermon import TrainerMon
    out, cfg_path = sys.argv[1], sys.argv[2]
    os.environ["MONITOR_OUTPUT_DIR"] = out
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = TrainerMon(cfg_path)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    step = 0
    while True:
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 10 == 0:
            print(step, flush=True)
    """
)


def test_sigkill_leaves_only_complete_parts(tmp_path):
    cfg = {
        "xy_distribution": True,
        "wg_distribution": True,
        "param_distribution": True,
        "ops": FULL_OPS,
        "format": ["parquet"],
        "parquet": {"steps_per_part": 3},
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "kill.py").write_text(KILL_SCRIPT)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "kill.py"), str(out), str(tmp_path / "cfg.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(glob.glob(str(out / "parquet" / "family=*" / "rank=0" / "part-*.parquet"))) >= 12:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the training subprocess wrote no parts within 60 s")
        time.sleep(0.13)  # kill at an arbitrary moment, likely mid-part
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    parts = glob.glob(str(out / "parquet" / "family=*" / "rank=*" / "*.parquet"))
    assert len(parts) >= 12
    for part in parts:  # every visible file is complete: footer and all rows readable
        table = pq.read_table(part)
        steps = table.column("step").to_pylist()
        first, last = (int(v) for v in os.path.basename(part).split("-")[1:3])
        assert set(steps) == set(range(first, last + 1))
        assert len(steps) == 3 * len(set(table.column("name").to_pylist()))  # 3 steps, all rows of each
    table = trainermon.load(out)
    per_step = table.group_by(["family", "step"]).aggregate([("name", "count")]).to_pylist()
    by_family: dict[str, set[int]] = {}
    for r in per_step:
        by_family.setdefault(r["family"], set()).add(r["name_count"])
    # Every family present, and every step of it complete (the same number of rows at every step).
    assert set(by_family) == {
        "actv",
        "actv_grad",
        "grad_unreduced",
        "grad_reduced",
        "param_origin",
        "param_updated",
    }
    assert all(len(counts) == 1 for counts in by_family.values()), by_family
    assert by_family["grad_reduced"] == {12}  # 6 Linear layers x (weight, bias)


def test_parquet_config_validation():
    cfg = parse_config({"format": ["parquet"], "parquet": {"steps_per_part": 5, "dir": "datasets/ds"}})
    assert cfg.parquet.steps_per_part == 5 and cfg.parquet.rows_per_part == 250_000
    assert cfg.parquet.dir == "datasets/ds"
    for escaping in ("/data/ds", "../ds", "a/../../ds"):  # only MONITOR_OUTPUT_DIR may point elsewhere
        with pytest.raises(ConfigError, match=r"parquet.dir.*relative to MONITOR_OUTPUT_DIR"):
            parse_config({"parquet": {"dir": escaping}})
    assert cfg.parquet.compression == "zstd"
    with pytest.raises(ConfigError, match=r"parquet.steps_per_part.*0.*integer in \[1,"):
        parse_config({"parquet": {"steps_per_part": 0}})
    with pytest.raises(ConfigError, match=r"parquet.compression.*'brotli'.*zstd"):
        parse_config({"parquet": {"compression": "brotli"}})
    with pytest.raises(ConfigError, match=r"parquet.rows_per_parts.*allowed.*rows_per_part"):
        parse_config({"parquet": {"rows_per_parts": 10}})
    with pytest.raises(ConfigError, match=r"parquet.seconds_per_part.*-1.*positive"):
        parse_config({"parquet": {"seconds_per_part": -1}})


def test_unwritable_dataset_dir_disables_only_parquet(tmp_path, monkeypatch):
    blocker = tmp_path / "out" / "blocker"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the dataset directory should be")
    cfg = full_config(parquet={"dir": "blocker/ds"})
    mon = run_monitored(tmp_path, cfg, steps=2, monkeypatch=monkeypatch)
    mon.close()
    assert [type(e).__name__ for e in mon.loop.worker.exporters] == ["CsvExporter"]
    assert len(read_csv_rows(mon.run_dir)) > 0  # training and the CSV sink went on


SECONDS_SCRIPT = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    import torch
    from trainermon import TrainerMon
    os.environ["MONITOR_OUTPUT_DIR"] = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(sys.argv[2])
    mon.set_monitor(model, optimizer=opt)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    # No further collected step (a long evaluation, a rare schedule): wait, without stepping, until the
    # time limit has written both families, or until the deadline; then die without closing.
    parts = pathlib.Path(sys.argv[1], "parquet")
    deadline = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < deadline:
        # a part ending at step 1: the limit may also have written step 0 alone first
        found = {p.parent.parent.name for p in parts.glob("family=*/rank=0/part-*-000000000001-*.parquet")}
        if found >= {"family=grad_unreduced", "family=grad_reduced"}:
            break
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_seconds_per_part_bounds_the_loss_without_a_further_step(tmp_path):
    """The time limit was checked only when a step arrived: a job killed without a further collected
    step lost both buffered steps, with seconds_per_part 1. The job waits (up to 60 s, no step) for the
    parts rather than a fixed 4 s: on a loaded host two fsynced part writes took longer than 3 s."""
    cfg = {
        "wg_distribution": True,
        "ops": ["norm"],
        "format": ["parquet"],
        "parquet": {"seconds_per_part": 1},
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "run.py").write_text(SECONDS_SCRIPT)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(out), str(tmp_path / "cfg.json"), "60"],
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    table = trainermon.load(out / "parquet", family="grad_reduced")
    assert sorted(set(table.column("step").to_pylist())) == [0, 1]
    assert sorted(table.column("name").to_pylist()) == ["bias", "bias", "weight", "weight"]
