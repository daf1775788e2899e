"""Activation rows carry msprobe's names (its module_hook numbering), checked on a small model:

- inputs numbered over the tensor arguments, integer ones included in the numbering but not written;
- a tuple output numbered by position, a None element written as a NaN row (nn.MultiheadAttention
  with need_weights=False returns (out, None): msprobe writes attn.output_0 and a NaN attn.output_1);
- actv_grad rows under the same names as the tensors' actv rows (no `_grad` suffix).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, ref_stats, write_config
from trainermon import TrainerMon


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 8)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.table(ids) * scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids, scale)
        out, _ = self.attn(h, h, h, need_weights=False)
        return out


def test_rows_are_named_as_msprobe_names_them(tmp_path, out_dir):
    torch.manual_seed(0)
    cfg = write_config(
        tmp_path / "c.json", xy_distribution=True, all_xy=True, ops=["norm", "max"], ndigits=12
    )
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    scale = torch.full((1,), 2.0, requires_grad=True)
    seen = {}
    model.attn.register_forward_hook(lambda m, a, o: seen.update(out=o[0].detach().clone()))
    model(ids, scale).square().sum().backward()
    opt.step()
    monitor.close()

    actv = keyed(read_family(monitor.run_dir, "actv"))
    names = {name for name, _, _ in actv}
    # embed(ids, scale): ids (integer) is input_0 and gets no row; scale is input_1
    assert {"embed.input_1", "embed.output"} <= names and "embed.input_0" not in names
    # attn(h, h, h) -> (out, None)
    assert {"attn.input_0", "attn.input_1", "attn.input_2", "attn.output_0", "attn.output_1"} <= names
    assert float(actv[("attn.output_0", 0, 0)]["norm"]) == pyapprox(ref_stats(seen["out"])["norm"])
    missing = actv[("attn.output_1", 0, 0)]
    assert math.isnan(float(missing["norm"])) and math.isnan(float(missing["max"]))
    grads = {name for name, _, _ in keyed(read_family(monitor.run_dir, "actv_grad"))}
    assert {
        "attn.input_0",
        "attn.input_1",
        "attn.input_2",
        "attn.output_0",
        "embed.output",
        "embed.input_1",
    } <= grads
    assert not any(n.endswith("_grad") or "_grad_" in n for n in grads), grads
    assert monitor.faults.total == 0


def pyapprox(value: float):
    import pytest

    return pytest.approx(value, rel=1e-6)


def test_msprobe_26_positional_order_is_understood(tmp_path, out_dir):
    """msprobe 26.2's set_monitor(model, optimizer, grad_acc_steps) beside the older keyword form."""
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, xy_distribution=True, all_xy=True)
    for call in ("positional", "keywords", "monitor_gnorm_with_ad", "set_wrapped_optimizer"):
        model = nn.Sequential(nn.Linear(2, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(cfg)
        if call == "positional":
            monitor.set_monitor(model, opt, 2)
        elif call == "keywords":
            monitor.set_monitor(model, grad_acc_steps=2, optimizer=opt)
        elif call == "monitor_gnorm_with_ad":  # msprobe's older name, its argument order
            monitor.monitor_gnorm_with_ad(model, opt, 2)
        else:  # msprobe's oldest form: the optimizer first, then the model alone
            monitor.set_wrapped_optimizer(opt)
            monitor.monitor_gnorm_with_ad(model, grad_acc_steps=2)
        for micro in range(2):
            model(torch.full((1, 2), float(micro + 1))).sum().backward()
        opt.step()
        monitor.close()
        assert monitor.loop.hooked and monitor.grad_acc_steps == 2, call
        micro_steps = {r["micro_step"] for r in read_family(monitor.run_dir, "actv")}
        assert micro_steps == {"0", "1"}, (call, micro_steps)
        assert read_family(monitor.run_dir, "grad_reduced"), call


def test_monitor_gnorm_with_ad_without_an_optimizer_says_what_is_missing(tmp_path, out_dir):
    monitor = TrainerMon(write_config(tmp_path / "c.json", wg_distribution=True))
    with pytest.raises(TypeError, match="set_wrapped_optimizer"):
        monitor.monitor_gnorm_with_ad(nn.Linear(2, 2))
    monitor.close()
