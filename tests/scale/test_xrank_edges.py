"""Cross-rank summaries at their edges, on 2 gloo ranks against each rank's own CSV rows: two rows of one
name on a rank (modules squashed to one name), statistics that are exactly 0, and the NaN placeholder row
of a None output element."""

from __future__ import annotations

import csv
import glob
import json
import os

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family


class Pair(nn.Module):
    """Returns (x, None), as nn.MultiheadAttention(need_weights=False) does."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def _job(rank: int, world: int, out: str) -> str:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        # squash_name: layers.0.norm and layers.1.norm both write `norm.input` / `norm.output`
        json.dump(
            {
                "xy_distribution": True,
                "forward_only": True,
                "squash_name": True,
                "ndigits": 17,
                "ops": ["norm", "max", "zeros"],
            },
            fh,
        )
    torch.manual_seed(rank)
    model = nn.Sequential()
    model.layers = nn.ModuleList([Block(), Block()])
    model.pair = Pair()
    model.forward = lambda x: model.pair(model.layers[1](model.layers[0](x)))[0]  # type: ignore[method-assign]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    model(torch.randn(3, 4) * (1 + 3 * rank)).pow(2).mean().backward()  # rank 1's rows are larger
    opt.step()
    opt.zero_grad()
    monitor.close()
    return monitor.run_dir


def test_rows_sharing_a_name_and_zero_statistics(tmp_path):
    run_dirs = run_ranks(_job, world_size=2, out=str(tmp_path))
    mine = {
        rank: [r for r in read_family(d, "actv") if r["name"] == "norm.output"]
        for rank, d in enumerate(run_dirs)
    }
    assert [len(rows) for rows in mine.values()] == [2, 2]  # two rows of one name on each rank
    rows = []
    for path in glob.glob(os.path.join(run_dirs[0], "xrank_*.csv")):
        with open(path, newline="") as fh:
            rows += list(csv.DictReader(fh))
    norms = [r for r in rows if r["name"] == "norm.output" and r["stat"] == "norm"]
    # one summary per row (not the last row's alone): each k-th row against the other rank's k-th row
    assert len(norms) == 2
    for k, summary in enumerate(norms):
        values = [float(mine[rank][k]["norm"]) for rank in (0, 1)]
        # the max carries the rank in its lowest mantissa bit: within 2^-51 relative (module docstring)
        assert float(summary["max"]) == pytest.approx(max(values), rel=1e-14, abs=0)
        assert int(summary["max_rank"]) == values.index(max(values))
    overall = max(float(r["norm"]) for rank in (0, 1) for r in mine[rank])
    # the job's largest norm is in the summaries
    assert max(float(r["max"]) for r in norms) == pytest.approx(overall, rel=1e-14, abs=0)
    # a statistic that is 0 on every rank (no zero elements): min and max exactly 0, never 5e-324
    zeros = [r for r in rows if r["stat"] == "zeros" and r["name"] != "pair.output_1"]
    assert zeros and all(float(r["min"]) == 0.0 and float(r["max"]) == 0.0 for r in zeros), zeros[:2]
    # a healthy run: no rank is named non-finite, the None output's placeholder row (norm NaN) included
    assert any(r["name"] == "pair.output_1" and r["norm"] == "nan" for r in read_family(run_dirs[0], "actv"))
    named = [r for r in rows if r["nonfinite_rank"] != "-1"]
    assert not named, named[:3]
    # `analyze` of the CSV output gives the cross-rank findings too (it once returned none for CSV)
    from trainermon.analysis.analyze import analyze

    found = analyze(str(tmp_path), progress=False).xrank
    assert found is not None and found["rows"] == len(rows)
    largest = [e for e in found["largest"] if e["family"] == "actv" and e["stat"] == "norm"]
    every = max(float(r["norm"]) for d in run_dirs for r in read_family(d, "actv"))
    assert largest and largest[0]["max"] == pytest.approx(every, rel=1e-14, abs=0)
