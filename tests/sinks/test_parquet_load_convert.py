"""Parquet loader (filtered reads, file pruning) and the CSV to Parquet converter."""

from __future__ import annotations

import glob
import json
import math
import os
import re

import numpy as np
import pytest
import torch

import trainermon
from tests.sinks.parquet_common import full_config, run_monitored
from trainermon import TrainerMon, parse_config
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.exporters import RunInfo
from trainermon.exporters.parquet import ParquetExporter


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
    """A misspelt path, family or name read as an empty table; a run directory whose output tree was moved
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
    name = trainermon.load(out, family="grad_reduced").column("name")[0].as_py()
    with pytest.raises(ValueError, match=rf"names \['x{name}'\] are not in .*close: \[.*'{name}'"):
        trainermon.load(out, family="grad_reduced", names=f"x{name}")  # before: an empty table
    assert trainermon.load(out, family="grad_reduced", names=name, steps=999).num_rows == 0  # there
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
