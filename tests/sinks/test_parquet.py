"""Parquet exporter, loader and CSV converter: values, layout, crash safety, file pruning."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

import trainermon
from tests.helpers import LayeredNet as Net
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.exporters import RunInfo
from trainermon.exporters.parquet import ParquetExporter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FULL_OPS = ["norm", "min", "max", "mean", "zeros", "nans", "infs", "numel"]


def run_monitored(tmp_path, cfg: dict, steps: int = 5, grad_acc: int = 2, monkeypatch=None) -> TrainerMon:
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, grad_acc_steps=grad_acc, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(grad_acc):
            model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return mon


def run_id_of(mon: TrainerMon) -> str:
    return os.path.basename(mon.run_dir).rsplit("-", 1)[-1]


def full_config(**extra) -> dict:
    cfg = {
        "xy_distribution": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": FULL_OPS,
        "ndigits": 17,  # 17 significant digits: the CSV text is the exact float64
        "format": ["csv", "parquet"],
    }
    cfg.update(extra)
    return cfg


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
        "max_head", "head_max_logit",
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


def _fake_batch(step: int, names: list[str], families: tuple[str, ...], value: float) -> StatBatch:
    rows = [RowMeta(f, 0, n, None, (2, 2), torch.float32, 4) for f in families for n in names]
    n = len(rows)
    values = {
        "norm": np.full(n, value),
        "mean": np.arange(n, dtype=np.float64) % len(names),
        "min": np.zeros(n),
        "max": np.ones(n),
        "zeros": np.zeros(n),
        "nans": np.zeros(n),
        "infs": np.zeros(n),
        "numel": np.full(n, 4.0),
    }
    return StatBatch(step=step, rows=rows, values=values)


def test_filtered_load_reads_only_needed_files(tmp_path):
    cfg = parse_config({"ops": ["norm", "mean"], "format": ["parquet"], "parquet": {"steps_per_part": 10}})
    names = [f"layers.{i}.weight" for i in range(20)]
    ranks, steps = 16, 50
    for rank in range(ranks):
        exp = ParquetExporter()
        exp.open(RunInfo(str(tmp_path / f"r{rank}"), str(tmp_path), rank, ranks, f"run{rank}", cfg))
        for step in range(steps):
            families = ("grad_reduced", "exp_avg", "param_updated")
            exp.write(_fake_batch(step, names, families, value=rank * 1000 + step))
        exp.close()
    root = tmp_path / "parquet"
    files = glob.glob(str(root / "family=*" / "rank=*" / "*.parquet"))
    assert len(files) == 3 * ranks * (steps // 10)
    wanted_family, wanted_ranks, wanted_steps = "exp_avg", (3, 7), (22, 27)
    needed = []
    for path in files:
        fam = path.split("family=")[1].split(os.sep)[0]
        rank = int(path.split("rank=")[1].split(os.sep)[0])
        first, last = (int(v) for v in os.path.basename(path).split("-")[1:3])
        if (
            fam == wanted_family
            and rank in wanted_ranks
            and first <= wanted_steps[1]
            and last >= wanted_steps[0]
        ):
            needed.append(path)
        else:  # any read of a file that is not needed now fails loudly
            with open(path, "wb") as fh:
                fh.write(b"not parquet")
    assert len(needed) == 2
    table = trainermon.load(
        root, family=wanted_family, ranks=list(wanted_ranks), steps=wanted_steps, names=["layers.5.weight"]
    )
    got = sorted(
        zip(
            table.column("rank").to_pylist(),
            table.column("step").to_pylist(),
            table.column("norm").to_pylist(),
        )
    )
    assert got == [(r, s, float(r * 1000 + s)) for r in wanted_ranks for s in range(22, 28)]
    assert set(table.column("mean").to_pylist()) == {5.0}
    # Other forms of the step filter, and pandas output.
    df = trainermon.load(root, family="exp_avg", ranks=3, steps=range(20, 30, 3), as_pandas=True)
    assert sorted(set(df["step"])) == [20, 23, 26, 29] and len(df) == 4 * len(names)
    assert trainermon.load(root, family="exp_avg", ranks=7, steps=[25]).num_rows == len(names)
    # the CLI's --steps text: "FIRST-LAST" and "N" (a string once read as the list ['2', '0', '-', ...])
    as_text = trainermon.load(root, family="exp_avg", ranks=3, steps="21-24", columns=["step"])
    assert sorted(set(as_text.column("step").to_pylist())) == [21, 22, 23, 24]
    assert trainermon.load(root, family="exp_avg", ranks=7, steps="25").num_rows == len(names)
    for bad in ("21..24", "-3", "a-b", "", "5-", "24-21"):
        with pytest.raises(ValueError, match=f"steps={bad!r}; allowed: an int.*'FIRST-LAST'"):
            trainermon.load(root, family="exp_avg", steps=bad)
    # selections that hold nothing, which read as an empty table or as no filter at all
    with pytest.raises(ValueError, match=r"steps=\(25, 21\): first > last"):
        trainermon.load(root, family="exp_avg", steps=(25, 21))
    for empty in ([], range(5, 5)):
        with pytest.raises(ValueError, match="selects nothing"):
            trainermon.load(root, family="exp_avg", steps=empty)
    with pytest.raises(ValueError, match=r"ranks=\[\] selects nothing"):
        trainermon.load(root, family="exp_avg", ranks=[])
    with pytest.raises(ValueError, match=r"columns \['nope'\] do not exist; allowed: \["):
        trainermon.load(root, family="exp_avg", columns=["step", "nope"])
    with pytest.raises(ValueError, match="families \\['nothing'\\] are not in"):  # not an empty table
        trainermon.load(root, family="nothing")
    with pytest.raises(Exception):  # noqa: B017 - proof that the corrupted files would have been noticed
        trainermon.load(root, family="exp_avg", ranks=[0])


def test_load_refuses_what_is_not_there_and_a_moved_tree_reads_its_own_copy(tmp_path, monkeypatch):
    """A misspelt path or family read as an empty table; a run directory whose output tree was moved
    read nothing (its pointer held the old absolute path), or the original where it still existed."""
    import shutil

    mon = run_monitored(
        tmp_path, {"wg_distribution": True, "ops": ["norm"], "format": ["parquet"]}, 2, 1, monkeypatch
    )
    mon.close()
    out = tmp_path / "out"
    rows = trainermon.load(out, family="grad_reduced").num_rows
    assert rows > 0 and trainermon.load(mon.run_dir, family="grad_reduced").num_rows == rows
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        trainermon.load(tmp_path / "ouy")
    with pytest.raises(FileNotFoundError, match="no trainermon Parquet dataset"):
        trainermon.load(tmp_path)  # holds out/, not a dataset
    with pytest.raises(ValueError, match=r"families \['grad_reducd'\] are not in .*'grad_reduced'"):
        trainermon.load(out, family="grad_reducd")
    shutil.copytree(out, tmp_path / "copy")
    moved = tmp_path / "copy" / os.path.basename(mon.run_dir)
    shutil.rmtree(out / "parquet" / "family=grad_reduced")  # the original loses its rows: the copy keeps them
    assert trainermon.load(moved, family="grad_reduced").num_rows == rows
    shutil.rmtree(out)
    assert trainermon.load(moved, family="grad_reduced").num_rows == rows
    from trainermon.analysis import open_run

    source = open_run(moved)
    assert source.kind == "parquet" and source.root == str(tmp_path / "copy" / "parquet")


def test_convert_trainermon_csv_matches_exporter(tmp_path, monkeypatch):
    mon = run_monitored(tmp_path, full_config(), steps=3, monkeypatch=monkeypatch)
    mon.close()
    from trainermon.cli import main

    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "converted")]) == 0
    a = trainermon.load(tmp_path / "converted").to_pylist()
    b = trainermon.load(tmp_path / "out" / "parquet").to_pylist()
    key = lambda r: (r["family"], r["step"], r["name"], r["micro_step"] or 0)  # noqa: E731
    assert len(a) == len(b) > 50
    for ra, rb in zip(sorted(a, key=key), sorted(b, key=key)):
        # micro_step: the CSV layout has one column per file (0 where the exporter stores null)
        ra.pop("micro_step"), rb.pop("micro_step")
        assert ra == rb


@pytest.mark.parametrize(
    "last_line, said",
    [
        ("0,w,1,0.3701", r"line 3: no value for \['max'\] of the header's 5 columns"),  # cut by a crash
        ("0,w,1,1.O3,2", r"line 3: column 'norm': '1.O3' is not a number"),  # a hand edit
        ("0,w,1,1.0,2,7", r"line 3: more fields than the header's 5 columns"),  # a comma in a name
        ("0,w,,1.0,2", r"line 3: column 'step': '' is not a whole number"),
        ("0,w,1.5,1.0,2", r"line 3: column 'step': '1.5' is not a whole number"),
        ("0,w,--5,1.0,2", r"line 3: column 'step': '--5' is not a whole number"),
    ],
)
def test_convert_refuses_a_damaged_line_instead_of_writing_nan(tmp_path, capsys, last_line, said):
    """A cut line became NaN in the converted dataset: a first NaN that the run never had."""
    from trainermon.cli import main

    rank_dir = tmp_path / "csv" / "Dec01_10-00-00-rank0-abc"
    rank_dir.mkdir(parents=True)
    (rank_dir / "grad_reduced_0-1.csv").write_text(
        f"vpp_stage,name,step,norm,max\n0,w,0,1.5,2\n{last_line}\n"
    )
    assert main(["convert", str(tmp_path / "csv"), str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert re.search(said, err) and "grad_reduced_0-1.csv" in err, err


def test_convert_msprobe_csv(tmp_path):
    rank_dir = tmp_path / "msprobe" / "Dec01_10-00-00-rank3-abc123"
    rank_dir.mkdir(parents=True)
    (rank_dir / "actv_0-1.csv").write_text(
        "vpp_stage,name,step,micro_step,norm,min,max,mean,shape,dtype\n"
        '0,layers.0.input,0,0,1.5,-1,1,0.25,"[2, 4]",torch.bfloat16\n'
        '0,layers.0.input,1,0,nan,-1,1,0.5,"[2, 4]",torch.bfloat16\n'
    )
    # Older msprobe files: no vpp_stage column, the chunk in a "{vpp}:" name prefix.
    (rank_dir / "grad_reduced_0-1.csv").write_text(
        "name,step,norm,max\n1:layers.2.weight,0,2.0,0.5\n1:layers.2.weight,1,inf,0.75\n"
    )
    from trainermon.convert import convert

    parts = convert(tmp_path / "msprobe", tmp_path / "ds")
    assert len(parts) == 2
    actv = trainermon.load(tmp_path / "ds", family="actv", ranks=3).to_pylist()
    assert [r["step"] for r in actv] == [0, 1]
    assert actv[0]["norm"] == 1.5 and math.isnan(actv[1]["norm"]) and actv[1]["mean"] == 0.5
    assert actv[0]["shape"] == [2, 4] and actv[0]["numel"] == 8 and actv[0]["dtype"] == "torch.bfloat16"
    assert actv[0]["run_id"] == "abc123" and actv[0]["micro_step"] == 0 and actv[0]["zeros"] is None
    grad = trainermon.load(tmp_path / "ds", family="grad_reduced").to_pylist()
    assert [(r["vpp_stage"], r["name"], r["norm"], r["max"]) for r in grad] == [
        (1, "layers.2.weight", 2.0, 0.5),
        (1, "layers.2.weight", math.inf, 0.75),
    ]
    assert grad[0]["numel"] is None and grad[0]["micro_step"] is None


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


def test_load_of_one_part_file_knows_its_family_and_rank(tmp_path):
    """`load(<a part file>)` read family None and rank 0 (the dataset's schema has no metadata), so
    its family and rank filters returned nothing."""
    cfg = parse_config({"ops": ["norm"], "format": ["parquet"]})
    exp = ParquetExporter()
    exp.open(RunInfo(str(tmp_path / "run"), str(tmp_path), 3, 4, "abcd", cfg))
    exp.write(_fake_batch(7, ["w"], ("grad_reduced",), value=1.5))
    exp.close()
    (part,) = glob.glob(str(tmp_path / "parquet" / "family=grad_reduced" / "rank=3" / "*.parquet"))
    rows = trainermon.load(part).select(["family", "rank", "step", "norm"]).to_pylist()
    assert rows == [{"family": "grad_reduced", "rank": 3, "step": 7, "norm": 1.5}]
    assert trainermon.load(part, family="grad_reduced", ranks=3).num_rows == 1
    assert trainermon.load(part, ranks=0).num_rows == 0


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


def test_convert_gives_a_none_output_no_elements(tmp_path, monkeypatch):
    """Without `numel` in `ops` the converter took numel from the shape: a None output (shape [])
    became 1 element where the exporter writes 0."""

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    path = tmp_path / "cfg.json"
    path.write_text(
        json.dumps(
            {"xy_distribution": True, "forward_only": True, "ops": ["norm"], "format": ["csv", "parquet"]}
        )
    )
    torch.manual_seed(0)
    model = Attn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer=opt)
    model(torch.randn(2, 3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    mon.close()
    from trainermon.cli import main

    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "converted")]) == 0
    cols = ["name", "dtype", "numel"]
    direct = trainermon.load(tmp_path / "out" / "parquet", family="actv").select(cols).to_pylist()
    converted = trainermon.load(tmp_path / "converted", family="actv").select(cols).to_pylist()
    assert {"name": "attn.output_1", "dtype": "None", "numel": 0} in direct
    assert sorted(converted, key=str) == sorted(direct, key=str)
