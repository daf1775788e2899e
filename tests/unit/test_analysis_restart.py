"""A restart into the same output directory: the crashed run wrote steps 0-5, the restart resumed from a
state saved before step 4 and wrote steps 4-7 on other data. The analysis reads steps 4-5 from the
restarted run only (never the two runs' rows added as shards), and steps 0-3 from the first run, on every
engine and for CSV and Parquet alike; values are checked against the gradients taken from torch."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from trainermon import TrainerMon
from trainermon.analysis.engines import engine_scan
from trainermon.analysis.grid import with_copy_marks
from trainermon.analysis.scan import scan
from trainermon.analysis.source import open_run

FAMILY = "grad_reduced"


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, ref: dict) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()
    # the reference: the gradient the optimizer steps with, in float64 (what grad_reduced describes)
    ref[seed] = {n: p.grad.detach().double() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()


def _job(out: str, monkeypatch: pytest.MonkeyPatch) -> dict[int, dict[str, dict]]:
    """Two runs into `out`; the reference gradients of each step that the restarted job kept."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", out)
    cfg = f"{out}.json"
    with open(cfg, "w") as fh:
        json.dump(
            {
                "wg_distribution": True,
                "format": ["csv", "parquet"],
                "ops": ["norm", "min", "max", "mean"],
                "ndigits": 17,
            },
            fh,
        )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    first: dict = {}
    for s in range(6):  # the crashed run: checkpoint before step 4, runs on to step 5
        if s == 4:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), mon.state_dict())
        _step(model, opt, s, first)
    mon.close()
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    mon = TrainerMon(cfg)
    mon.load_state_dict(saved[2])
    mon.set_monitor(model, optimizer=opt)
    second: dict = {}
    for s in range(4, 8):  # the restart, on other data: its steps 4-5 differ from the crashed run's
        _step(model, opt, s + 100, second)
    mon.close()
    kept = {s: first[s] for s in range(4)}
    kept.update({s: second[s + 100] for s in range(4, 8)})
    for s in (4, 5):  # the overlapped rows really differ (else copies would hide the bug)
        assert not torch.equal(first[s]["0.weight"], second[s + 100]["0.weight"])
    return kept


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("restart") / "out")
    with pytest.MonkeyPatch.context() as mp:
        ref = _job(out, mp)
    return out, ref


def _summary(out: str, how: str):
    fmt, engine = how.split("-")
    source = open_run(out, prefer=fmt)
    assert source.kind == fmt
    stats = with_copy_marks(["norm", "min", "max", "mean"])
    if engine == "pyarrow":
        return scan(source, families=[FAMILY], stats=stats)
    pytest.importorskip(engine)
    return engine_scan(source, engine, {FAMILY: stats})


@pytest.mark.parametrize("how", ["csv-pyarrow", "parquet-pyarrow", "parquet-duckdb"])
def test_restart_overlap_reads_the_latest_run(restarted: tuple[str, dict], how: str) -> None:
    out, ref = restarted
    summary = _summary(out, how)
    grid = summary.grids[FAMILY]
    for stat in ("norm", "max", "mean"):
        values, keys, order = grid.values(stat)
        assert keys.tolist() == list(range(8))
        for row, name in enumerate(grid.labels(order)):
            for col, step in enumerate(keys.tolist()):
                g = ref[step][name]
                want = {"norm": g.norm(), "max": g.max(), "mean": g.mean()}[stat].item()
                got = float(values[row, col])
                assert math.isclose(got, want, rel_tol=2e-6, abs_tol=1e-12), (
                    how,
                    stat,
                    name,
                    step,
                    got,
                    want,
                )
    # one row per (tensor, step): the earlier run's rows of steps 4-5 are not read
    assert grid.rows == len(grid.tensors) * 8
    notes = [n for n in summary.notes if "latest-started run are used" in n]
    assert len(notes) == 1 and "2 steps (4-5)" in notes[0], summary.notes


def test_single_run_is_untouched(restarted: tuple[str, dict]) -> None:
    """--run-id still reads one run alone, all its steps (the crashed run's 4-5 included)."""
    out, _ref = restarted
    ids = sorted({f.run_id for f in open_run(out, prefer="csv").files})
    assert len(ids) == 2
    for rid in ids:
        summary = scan(open_run(out, prefer="csv", run_id=rid), families=[FAMILY], stats=["norm"])
        steps = summary.grids[FAMILY].values("norm")[1].tolist()
        assert steps in (list(range(6)), list(range(4, 8)))
        assert not [n for n in summary.notes if "latest-started" in n]
    assert np.isfinite(summary.grids[FAMILY].values("norm")[0]).all()


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_compare_against_the_restarted_run_alone(restarted: tuple[str, dict], fmt: str) -> None:
    """The audit's symptom: the directory compared with its own restarted run (`--benchmark-run-id`)
    diverged at the overlapped steps; now the steps they share are equal, and the note is passed on."""
    from trainermon.analysis.compare import compare

    out, _ref = restarted
    ids = {f.run_id: f.first_step for f in open_run(out, prefer=fmt).files}
    later = max(ids, key=lambda rid: ids[rid])  # the restart's files start at step 4
    result = compare(open_run(out, prefer=fmt), open_run(out, prefer=fmt, run_id=later), rtol=1e-6)
    assert result.first is None, result.first
    assert int(result.per_family["cells_compared"].sum()) > 0
    assert any("2 steps (4-5)" in n for n in result.notes), result.notes


def test_three_runs_each_step_from_the_latest_that_wrote_it() -> None:
    """Runs a (steps 0-5), b (3-6), c (5-8) of one rank, read latest first: each step from the latest."""
    from trainermon.analysis.runs import Replaced, keep_latest
    from trainermon.analysis.source import Batch

    def batch(run: str, steps: range) -> Batch:
        st = np.asarray(list(steps), dtype=np.int64)
        value = np.full(len(st), float(ord(run)))
        return Batch(
            FAMILY,
            0,
            [(0, "w")],
            np.zeros(len(st), np.int64),
            st,
            np.full(len(st), -1),
            {"norm": (value, None)},
            None,
            run,
        )

    order = {"a": 0, "b": 1, "c": 2}
    replaced = Replaced()
    got = {}
    for b in keep_latest(
        iter([batch("c", range(5, 9)), batch("b", range(3, 7)), batch("a", range(6))]),
        {r: r for r in order},
        order,
        replaced,
    ):
        for s, v in zip(b.step.tolist(), b.stats["norm"][0].tolist()):
            assert s not in got
            got[s] = chr(int(v))
    assert got == {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "c", 6: "c", 7: "c", 8: "c"}
    want = {3: ("a", "b"), 4: ("a", "b"), 5: ("a", "c"), 6: ("b", "c")}
    assert replaced.steps == {(FAMILY, 0, s): runs for s, runs in want.items()}


# ---- the cross-rank summaries (family xrank, rank 0) after a restart -------------------------------------
def _xrank_input(rank: int, step: int, restart: bool) -> torch.Tensor:
    seed = 10 * step + rank + (100 if restart else 0)  # the restart trains its steps 4-5 on other data
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    if not restart and step == 5 and rank == 1:
        x[0, 0] = float("nan")  # the crash: a NaN input on rank 1 at step 5
    return x


def _xrank_job(rank: int, world_size: int, out: str) -> None:
    """2 ranks: run A steps 0-5 (NaN on rank 1 at step 5), state saved after step 3; run B, started later
    into the same directory, resumes from it and redoes steps 4-5 clean."""
    import os
    import time

    import torch.distributed as dist

    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        json.dump(
            {
                "xy_distribution": True,
                "format": ["csv", "parquet"],
                "ops": ["norm", "max", "nans"],
                "xrank_summary": True,
                "ndigits": 17,
            },
            fh,
        )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    saved: tuple = ()  # (model, monitor) state before step 4 (SGD without momentum keeps none)
    for restart in (False, True):
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        if restart:
            model.load_state_dict(saved[0])
            mon.load_state_dict(saved[1])
        for s in range(4, 6) if restart else range(6):
            if s == 4 and not restart:
                saved = (copy.deepcopy(model.state_dict()), mon.state_dict())
            model(_xrank_input(rank, s, restart)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        mon.close()
        dist.barrier()
        time.sleep(1.1)  # a CSV rank directory's name has the start to the second: B's is later


@pytest.fixture(scope="module")
def xrank_restarted(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.distributed import run_ranks

    out = str(tmp_path_factory.mktemp("xrank") / "out")
    import os

    os.makedirs(out)
    run_ranks(_xrank_job, world_size=2, timeout=400, out=out)
    return out


@pytest.mark.parametrize("how", ["csv-pyarrow", "parquet-pyarrow", "parquet-duckdb", "parquet-spark"])
def test_restart_xrank_rows_follow_the_latest_run(xrank_restarted: str, how: str) -> None:
    """The xrank findings read steps 4-5 from the restart only: no first NaN from the crashed run's step 5
    (the tensor families say none either), one row per (tensor, statistic, step), and the values are the
    restart's: max/min over ranks of each rank's input norm, computed here from the inputs."""
    from trainermon.analysis.analyze import analyze

    fmt, engine = how.split("-")
    if engine != "pyarrow":
        pytest.importorskip("pyspark" if engine == "spark" else engine)
    source = open_run(xrank_restarted, prefer=fmt)
    assert source.kind == fmt
    a = analyze(source, engine=engine)
    rows = a.summary.xrank_rows
    assert a.xrank["first_nonfinite"] is None, a.xrank["first_nonfinite"]
    assert not len(a.first_nonfinite), a.first_nonfinite  # the tensor families: no NaN either
    per_step = rows.groupby("step").size().to_dict()
    assert sorted(per_step) == list(range(6)) and len(set(per_step.values())) == 1, per_step
    assert int(rows["nans"].fillna(0).sum()) == 0
    inp = rows[
        (rows["xrank_family"] == "actv") & (rows["name"] == "0.input") & (rows["xrank_stat"] == "norm")
    ]
    assert sorted(inp["step"].tolist()) == list(range(6))
    for r in inp.itertuples(index=False):
        norms = [float(_xrank_input(k, int(r.step), int(r.step) >= 4).double().norm()) for k in range(2)]
        assert math.isclose(float(r.max), max(norms), rel_tol=1e-6), (how, r.step, r.max, norms)
        assert math.isclose(float(r.min), min(norms), rel_tol=1e-6), (how, r.step, r.min, norms)
