"""One real 4-rank job (gloo, DDP): the job-wide run id in every sink, and the cross-rank summaries
(family xrank, written by rank 0) against what this test computes from every rank's own rows, with a NaN
injected into rank 3's input at the last step.

All checks of the 4-rank run share one launch (spawning ranks is the expensive part)."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import urllib.request

import pyarrow.dataset as ds
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.helpers import read_family

WORLD = 4
STEPS = 3
NAN_RANK, NAN_STEP = 3, 2
OPS = ["norm", "mean", "min", "max", "nans", "infs"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _job(rank: int, world: int, out: str) -> dict:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out, f"config-rank{rank}.json")
    os.makedirs(out, exist_ok=True)
    with open(cfg, "w") as fh:
        json.dump(
            {
                "xy_distribution": True,
                "wg_distribution": True,
                "ops": OPS,
                "ndigits": 17,
                "format": ["csv", "parquet", "prometheus"],
                "write_interval_s": 0,
            },
            fh,
        )
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data: per-rank rows differ
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=gen)
        if rank == NAN_RANK and step == NAN_STEP:
            x[0, 0] = float("nan")  # rank 3's own activations and pre-reduce gradients go non-finite
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.flush()
    with open(os.path.join(monitor.run_dir, "prometheus.json")) as fh:
        url = json.load(fh)["url"]
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    sd = sorted(glob.glob(os.path.join(out, "prometheus_sd", f"rank{rank}-*.json")))
    sd_labels = [json.load(open(p))[0]["labels"] for p in sd]
    run_dir = monitor.run_dir
    transfers, merged_by = monitor.loop.transfers.count, monitor.loop.xrank.merged_by
    monitor.close()
    return {"run_dir": run_dir, "page": page, "sd_labels": sd_labels, "transfers": transfers,
            "merged_by": merged_by, "uneven": _uneven(rank, out)}  # fmt: skip


def _uneven(rank: int, out: str) -> dict:
    """Ranks with different rows (as pipeline stages and module_ranks give): even ranks have a layer
    the odd ranks lack, and only ranks 0 and 2 collect activations. No deadlock, and the summaries of
    each row come from the ranks that hold it. Merged as on a large job: two all-reduces, not the
    all-gather (`stats.partials.GATHER_BYTES` set to 0), with a NaN in rank 2's input at the last step."""
    from trainermon import TrainerMon
    from trainermon.stats import partials

    partials.GATHER_BYTES = 0

    out = os.path.join(out, "uneven")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.makedirs(out, exist_ok=True)
    cfg = os.path.join(out, f"config-rank{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"xy_distribution": True, "wg_distribution": True, "module_ranks": [0, 1, 2], "ops": OPS,
                   "ndigits": 17, "write_interval_s": 0}, fh)  # fmt: skip
    torch.manual_seed(rank)
    layers = [nn.Linear(4, 4), nn.Tanh()] + ([nn.Linear(4, 4)] if rank % 2 == 0 else [])
    model = nn.Sequential(*layers, nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(2):
        x = torch.randn(3, 4)
        if rank == 2 and step == 1:
            x[0, 0] = float("nan")
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.flush()
    agreements, merged_by = monitor.loop.xrank.agreements, monitor.loop.xrank.merged_by
    monitor.close()
    return {"run_dir": monitor.run_dir, "agreements": agreements, "merged_by": merged_by}


def test_four_rank_job(tmp_path):
    out = str(tmp_path / "out")
    results = run_ranks(_job, world_size=WORLD, timeout=300, out=out)

    # ---- one run id for the whole job, in every sink ----------------------------------------------
    names = [os.path.basename(r["run_dir"]) for r in results]
    ids = {n.rsplit("-", 1)[-1] for n in names}
    assert len(ids) == 1, names
    run_id = ids.pop()
    for rank, name in enumerate(names):
        # msprobe's layout: {time}-rank{R}-{id}, and rank 0's start time on every rank
        assert name == f"{names[0].split('-rank')[0]}-rank{rank}-{run_id}"
    table = ds.dataset(os.path.join(out, "parquet"), partitioning="hive").to_table()
    assert set(table.column("run_id").to_pylist()) == {run_id}
    assert set(table.column("rank").to_pylist()) == set(range(WORLD))
    for rank, r in enumerate(results):
        info = [
            s.labels
            for fam in text_string_to_metric_families(r["page"])
            for s in fam.samples
            if s.name == "trainermon_info"
        ]
        assert [i["run_id"] for i in info] == [run_id] and info[0]["rank"] == str(rank)
        # the file_sd target label, which Prometheus puts on every series it scrapes from the rank
        assert r["sd_labels"] == [{"run_id": run_id}]

    # ---- cross-rank summaries ---------------------------------------------------------------------
    expected = _expected(results)
    xrank_csv = _read_xrank(results[0]["run_dir"])
    assert not glob.glob(os.path.join(results[1]["run_dir"], "xrank_*.csv"))  # rank 0 writes them
    assert set(xrank_csv) == set(expected)
    _same_summaries(xrank_csv, expected)
    assert [r["merged_by"] for r in results] == ["all_gather"] * WORLD  # a small job: one collective
    # the summaries ride in each step's single device-to-host copy
    assert [r["transfers"] for r in results] == [STEPS] * WORLD
    assert len({v["max_rank"] for v in expected.values()}) > 1  # not a constant: the argmax is checked
    bad = {k: v["nonfinite_rank"] for k, v in expected.items() if v["nonfinite_rank"] >= 0}
    families = {k[0] for k in bad}
    assert families == {"actv", "actv_grad", "grad_unreduced"} and set(bad.values()) == {NAN_RANK}
    assert {k[2] for k in bad} == {NAN_STEP}
    # Parquet holds the same summaries (family xrank, rank 0)
    xr = ds.dataset(os.path.join(out, "parquet"), partitioning="hive").to_table(
        filter=ds.field("family") == "xrank"
    )
    assert set(xr.column("rank").to_pylist()) == {0} and xr.num_rows == len(expected)
    for row in xr.to_pylist():
        key = (row["xrank_family"], row["name"], row["step"], row["micro_step"], row["xrank_stat"])
        got = xrank_csv[key]
        assert row["max_rank"] == got["max_rank"] and row["nonfinite_rank"] == got["nonfinite_rank"]
        assert row["max"] == got["max"] or (math.isnan(row["max"]) and math.isnan(got["max"]))
    # `trainermon convert` turns rank 0's xrank CSV into the same Parquet rows
    from trainermon.convert import convert

    convert(out, str(tmp_path / "converted"))
    conv = ds.dataset(str(tmp_path / "converted"), partitioning="hive").to_table(
        filter=(ds.field("family") == "xrank") & (ds.field("run_id") == run_id)
    )
    columns = ("xrank_family", "name", "step", "micro_step", "xrank_stat", "max_rank", "min_rank", "ranks")
    assert sorted(tuple(r[c] for c in columns) for r in conv.to_pylist()) == sorted(
        tuple(r[c] for c in columns) for r in xr.to_pylist()
    )
    # Prometheus (rank 0 only): the per-layer first non-finite rank of the last (NaN) step
    page0 = list(text_string_to_metric_families(results[0]["page"]))
    first = {
        (s.labels["family"], s.labels["layer"]): s.value
        for fam in page0
        for s in fam.samples
        if s.name == "trainermon_xrank_nonfinite" and s.labels["agg"] == "first_rank"
    }
    assert first and set(first.values()) == {float(NAN_RANK)}
    assert not [
        s
        for fam in text_string_to_metric_families(results[1]["page"])
        for s in fam.samples
        if s.name.startswith("trainermon_xrank")
    ]

    # ---- ranks with different rows ---------------------------------------------------------------
    uneven = [r["uneven"] for r in results]
    assert [u["agreements"] for u in uneven] == [1] * WORLD  # the layout is agreed once, not per step
    assert [u["merged_by"] for u in uneven] == ["all_reduce"] * WORLD
    expected = _expected(uneven)
    got = _read_xrank(uneven[0]["run_dir"])
    assert set(got) == set(expected)
    _same_summaries(got, expected)
    assert {v["nonfinite_rank"] for v in expected.values()} == {-1, 2}  # rank 2's NaN is found
    ranks_of = {(k[0], k[1]): v["ranks"] for k, v in got.items()}
    # the even ranks' head is "3": only they hold it (the odd ranks' head is "2")
    assert ranks_of[("grad_unreduced", "3.weight")] == 2
    # module_ranks [0, 1, 2]: rank 3 writes no per-rank rows (actv, actv_grad, grad_unreduced)
    actv = {name: v for (fam, name), v in ranks_of.items() if fam == "actv"}
    assert {v for name, v in actv.items() if name.startswith("3.")} == {2}  # ranks 0 and 2 hold "3"
    assert {v for name, v in actv.items() if not name.startswith("3.")} == {3}
    assert ranks_of[("grad_unreduced", "0.weight")] == 3


STATS = ("norm", "mean", "min", "max")


def _same_summaries(got: dict, expected: dict) -> None:
    # max and min: the value with its 2 lowest mantissa bits cleared (4 ranks), see collect/xrank.py
    rel = 2.0**-49
    for key, want in expected.items():
        for col in ("max", "min", "mean"):
            if math.isnan(want[col]):
                assert math.isnan(got[key][col]), (key, col)
            else:
                # mean: a sum of at most 4 float64 values (any order) divided by their count, each
                # addition's rounding 2^-53 relative to a sum no larger than 4 x the largest term
                scale = max(abs(want[col]), abs(want["max"]), abs(want["min"]))
                assert abs(got[key][col] - want[col]) <= rel * scale + 1e-300, (key, col, got[key], want)
        for col in ("max_rank", "min_rank", "nans", "infs", "nonfinite_rank", "ranks"):
            assert got[key][col] == want[col], (key, col, got[key][col], want[col])


def _expected(results: list) -> dict:
    """Summaries computed here from each rank's own CSV rows (17 significant digits: exact float64)."""
    per_key: dict[tuple, dict[int, dict]] = {}
    for rank, r in enumerate(results):
        for family in ("actv", "actv_grad", "grad_unreduced"):
            for row in read_family(r["run_dir"], family):
                micro = int(row["micro_step"]) if row.get("micro_step", "") != "" else None
                for stat in STATS:
                    key = (family, row["name"], int(row["step"]), micro, stat)
                    per_key.setdefault(key, {})[rank] = {
                        "v": float(row[stat]),
                        "nans": int(row["nans"]),
                        "infs": int(row["infs"]),
                        "bad": int(row["nans"]) + int(row["infs"]) > 0
                        or not all(math.isfinite(float(row[s])) for s in STATS),
                    }
    out = {}
    for key, ranks in per_key.items():
        finite = {k: v["v"] for k, v in ranks.items() if not math.isnan(v["v"])}
        top = max(finite.values()) if finite else math.nan
        low = min(finite.values()) if finite else math.nan
        out[key] = {
            "max": top,
            "min": low,
            "mean": sum(finite.values()) / len(finite) if finite else math.nan,
            "max_rank": min((k for k, v in finite.items() if v == top), default=-1),
            "min_rank": min((k for k, v in finite.items() if v == low), default=-1),
            "nans": sum(v["nans"] for v in ranks.values()),
            "infs": sum(v["infs"] for v in ranks.values()),
            "nonfinite_rank": min((k for k, v in ranks.items() if v["bad"]), default=-1),
            "ranks": len(ranks),
        }
    return out


def _read_xrank(run_dir: str) -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "xrank_*.csv"))):
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                micro = int(row["micro_step"]) if row["micro_step"] != "" else None
                key = (row["family"], row["name"], int(row["step"]), micro, row["stat"])
                assert key not in out
                out[key] = {
                    **{c: float(row[c]) for c in ("max", "min", "mean")},
                    **{
                        c: int(row[c])
                        for c in ("max_rank", "min_rank", "nans", "infs", "nonfinite_rank", "ranks")
                    },
                }
    return out
