"""The demo: its closing summary reads each family's own CSV files back; its model gives no warning."""

from __future__ import annotations

import csv
import glob
import logging
import os

import torch
from torch import nn

from trainermon.demo import summarize


def _write(path, rows: list[tuple[int, str, float]]) -> None:
    lines = ["vpp_stage,name,step,norm"] + [f"0,{name},{step},{norm}" for step, name, norm in rows]
    path.write_text("\n".join(lines) + "\n")


def test_summary_takes_each_familys_rows_not_a_longer_namesakes(tmp_path):
    """`exp_avg` and `exp_avg_sq`, `actv` and `actv_grad` share a prefix; each heading shows its own."""
    _write(tmp_path / "exp_avg_0-0.csv", [(0, "w", 0.5)])
    _write(tmp_path / "exp_avg_sq_0-0.csv", [(0, "w", 2.5e-5)])
    _write(tmp_path / "actv_0-0.csv", [(0, "fc.output", 162.0)])
    _write(tmp_path / "actv_grad_0-0.csv", [(0, "fc.output", 0.02)])
    _write(tmp_path / "grad_reduced_0-1.csv", [(0, "w", 1.0), (1, "w", 3.0), (1, "b", 4.0)])
    lines = summarize(str(tmp_path))
    text = "\n".join(lines)
    assert "0.5  w" in text and "2.5e-05" not in text, text
    assert "162  fc.output" in text and "0.02" not in text, text
    # the last step's rows, largest norm first
    heading = lines.index("  grad_reduced (step 1), largest norms:")
    assert lines[heading + 1 : heading + 3] == [f"    {4.0:12.6g}  b", f"    {3.0:12.6g}  w"], lines


def test_demo_says_nothing_about_itself(tmp_path, out_dir, static_mode, caplog):
    """The demo warned about its own model: nn.MultiheadAttention never calls its out_proj module, so 4 of
    the selected modules "ran no forward". With every module selected that torch design is said at INFO;
    every other module below the root with a forward has actv rows."""
    from trainermon.demo import TinyGPT, run_demo

    with caplog.at_level(logging.INFO, logger="trainermon"):
        run_dir = run_demo(steps=1, grad_acc=1, output_dir=str(out_dir), quiet=True)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    said = [r.getMessage() for r in caplog.records if "never runs as a module" in r.getMessage()]
    assert len(said) == 1 and "layers.0.attn.out_proj" in said[0], said
    with open(glob.glob(os.path.join(run_dir, "actv_[0-9]*.csv"))[0], newline="") as fh:
        written = {row["name"].rpartition(".")[0] for row in csv.DictReader(fh)}
    modules = {
        n
        for n, m in TinyGPT().named_modules()
        if n and not isinstance(m, nn.ModuleList) and not n.endswith("attn.out_proj")
    }
    assert written == modules, modules ^ written


def test_a_targeted_attention_out_proj_is_a_warning(tmp_path, out_dir, static_mode, caplog):
    """Named in the targets, MultiheadAttention's out_proj (no rows, by torch's design) is a warning that
    says why; the other targeted module writes its rows."""
    from trainermon import TrainerMon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Identity())
    model.attn = nn.MultiheadAttention(8, 2, batch_first=True)
    config = tmp_path / "c.json"
    config.write_text('{"targets": {"attn.out_proj": {}, "0": {}}, "xy_distribution": true}')
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(str(config))
    with caplog.at_level(logging.INFO, logger="trainermon"):
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        x = model[0](torch.randn(2, 3, 8))
        model.attn(x, x, x, need_weights=False)[0].sum().backward()
        opt.step()
        opt.zero_grad()
        monitor.close()
    said = [r for r in caplog.records if "never runs as a module" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING] and "attn.out_proj" in said[0].getMessage()
    assert not [r for r in caplog.records if "ran no forward" in r.getMessage()]
    rows = glob.glob(os.path.join(str(out_dir), "*", "actv_[0-9]*.csv"))
    with open(rows[0], newline="") as fh:
        assert {row["name"] for row in csv.DictReader(fh)} == {"0.input", "0.output"}
