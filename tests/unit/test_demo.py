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


def test_causal_self_attention_is_multihead_attention():
    """The demo's attention equals torch's nn.MultiheadAttention with a causal mask and the same weights
    (float32, unit-scale inputs, d = 32: different summation orders differ by a few ulps of O(1) values)."""
    from trainermon.demo import CausalSelfAttention

    torch.manual_seed(0)
    ours = CausalSelfAttention(32, 4)
    ref = nn.MultiheadAttention(32, 4, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.in_proj_bias.copy_(ours.qkv.bias)
        ref.out_proj.weight.copy_(ours.proj.weight)
        ref.out_proj.bias.copy_(ours.proj.bias)
    x = torch.randn(3, 7, 32)
    mask = torch.triu(torch.ones(7, 7, dtype=torch.bool), diagonal=1)  # True: may not attend
    want = ref(x, x, x, attn_mask=mask, need_weights=False)[0]
    torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)


def test_demo_says_nothing_about_itself(tmp_path, out_dir, static_mode, caplog):
    """The demo warned about its own model: nn.MultiheadAttention never calls its out_proj module, so 4 of
    the selected modules "ran no forward". Every module below the root with a forward now has actv rows."""
    from trainermon.demo import TinyGPT, run_demo

    with caplog.at_level(logging.WARNING, logger="trainermon"):
        run_dir = run_demo(steps=1, grad_acc=1, output_dir=str(out_dir), quiet=True)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    with open(glob.glob(os.path.join(run_dir, "actv_[0-9]*.csv"))[0], newline="") as fh:
        written = {row["name"].rpartition(".")[0] for row in csv.DictReader(fh)}
    modules = {n for n, m in TinyGPT().named_modules() if n and not isinstance(m, nn.ModuleList)}
    assert written == modules, modules ^ written
