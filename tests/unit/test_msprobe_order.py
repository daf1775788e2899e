"""Row order in the CSV files as msprobe writes it: actv_grad rows module by module, each module's input
rows then its output rows, the modules in the order msprobe's backward hook runs for them (when their
input gradients are done). trainermon's hooks record the rows as the gradients arrive (a module's output
gradient long before its input gradient); the CSV exporter writes them in msprobe's order."""

from __future__ import annotations

import csv
import glob
import importlib.util
import os

import pytest
import torch
from torch import nn

from exporters.csv import _io_key, msprobe_grad_order
from trainermon import TrainerMon
from trainermon.collect.records import RowMeta


def _names(path: str) -> list[tuple[str, str]]:
    with open(path, newline="") as fh:
        return [(r["name"], r["micro_step"]) for r in csv.DictReader(fh)]


def test_order_of_rows_as_the_gradients_arrive():
    def row(name: str, micro: int = 0) -> RowMeta:
        return RowMeta("actv_grad", 0, name, micro, (2,), torch.float32, 2)

    arrived = [
        "head.output",
        "head.input",
        "blk.output_1",  # a tuple output, its elements numbered
        "blk.output_0",
        "blk.attn.output.dense.output",  # a module named `output` (BERT's attention.output)
        "blk.attn.output.dense.input",
        "blk.input_1",  # inputs numbered: msprobe writes them by number
        "blk.input_kw",  # a keyword argument's gradient (msprobe writes none): after the numbered ones
        "blk.input_0",
        "emb.output",  # no input takes a gradient: msprobe's hook runs with the output's
    ]
    rows = [row(n) for n in arrived] + [row(n, 1) for n in arrived]
    order = msprobe_grad_order(rows, [_io_key(r.name) for r in rows])
    expected = [
        "head.input",
        "head.output",
        "blk.attn.output.dense.input",
        "blk.attn.output.dense.output",
        "blk.input_0",
        "blk.input_1",
        "blk.input_kw",
        "blk.output_0",
        "blk.output_1",
        "emb.output",
    ]
    assert [(rows[i].name, rows[i].micro_step) for i in order] == [(n, 0) for n in expected] + [
        (n, 1) for n in expected
    ]


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc, self.act = nn.LayerNorm(d), nn.Linear(d, d), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(self.norm(x)))


class _Model(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_actv_grad_csv_in_msprobe_order(tmp_path, out_dir, static_mode):
    """Residual blocks, 2 micro-batches: msprobe's actv_grad file, less the
    rows trainermon does not write (the root module's; NaN rows of inputs that take no gradient)."""
    torch.manual_seed(0)
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"xy_distribution": true, "ops": ["norm"], "collect_times": 2}')
    monitor = TrainerMon(str(cfg), params_have_main_grad=False)
    monitor.set_monitor(model, opt, grad_acc_steps=2)
    for _ in range(2):
        for _ in range(2):
            model(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    one = [
        *("head.input", "head.output", "layers.1.act.input", "layers.1.act.output"),
        *("layers.1.fc.input", "layers.1.fc.output", "layers.1.norm.input", "layers.1.norm.output"),
        *("layers.1.input", "layers.1.output", "layers.0.output", "layers.0.act.input"),
        *("layers.0.act.output", "layers.0.fc.input", "layers.0.fc.output", "layers.0.norm.output"),
    ]
    expected = [(n, "0") for n in one] + [(n, "1") for n in one]
    for step in (0, 1):
        (path,) = glob.glob(os.path.join(str(out_dir), "*", f"actv_grad_{step}-{step}.csv"))
        assert _names(path) == expected, step


def _rows(out: str) -> dict[str, list[tuple]]:
    files = {}
    for path in glob.glob(os.path.join(out, "*", "actv_grad_*.csv")):
        with open(path, newline="") as fh:
            files[os.path.basename(path)] = [
                (r["name"], r["step"], r["micro_step"], r["shape"]) for r in csv.DictReader(fh)
            ]
    return files


@pytest.mark.skipif(importlib.util.find_spec("msprobe") is None, reason="mindstudio-probe is not installed")
def test_actv_grad_order_side_by_side_with_msprobe(msprobe_gpt):
    """tests/msprobe_gpt.py through both tools: the same rows in the same order in every actv_grad file,
    but for the rows trainermon deliberately does not write (test_msprobe_side_by_side)."""
    got = {tool: _rows(msprobe_gpt(tool)) for tool in ("msprobe", "trainermon")}
    assert sorted(got["msprobe"]) == sorted(got["trainermon"]) and got["msprobe"]
    for name, theirs in got["msprobe"].items():
        expected = [r[:3] for r in theirs if not r[0].startswith(".") and r[3] != "nan"]
        assert [r[:3] for r in got["trainermon"][name]] == expected, name
