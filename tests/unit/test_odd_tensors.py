"""Unusual tensors next to ordinary ones: a nested-tensor input or output costs no other tensor its rows, a
complex gradient counts in the global gradient norm (as in clip_grad_norm_), a gradient that cannot be read
makes the norm NaN rather than silently low, and a refused tensor is told once by name, without a
traceback."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon
from trainermon.collect.records import RowMeta, StepPayload
from trainermon.failsafe import FaultLog
from trainermon.pipeline.derive import Deriver
from trainermon.stats import NANS, SUMSQ, empty_partials

OPS = ["norm", "min", "max", "mean", "nans"]


class Two(nn.Module):
    def forward(self, dense, nested):
        return dense * 2.0 + torch.nested.to_padded_tensor(nested, 0.0).sum()


class Emit(nn.Module):
    def forward(self, h):  # (dense, strided nested) outputs, both requiring grad
        return h * 3.0, torch.nested.as_nested_tensor([h[0:2], h[2:5]])


class NestedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(4, 4)
        self.emit = Emit()
        self.two = Two()
        self.c = nn.Linear(4, 1)

    def forward(self, x):
        h = self.p(x)
        dense, nested = self.emit(h)
        return self.c(self.two(dense, nested)).square().sum()


def _nested_run(tmp_path, monkeypatch, monitored: bool):
    """Two SGD steps of NestedModel; the reference run records the gradient reaching `two`'s dense input
    and `emit`'s dense output with tensor hooks, and both values."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = NestedModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    refs: list[dict[str, torch.Tensor]] = []
    if not monitored:

        def pre(module, args):
            refs[-1]["value"] = args[0].detach().double().clone()
            args[0].register_hook(lambda g: refs[-1].__setitem__("grad", g.detach().double().clone()))

        model.two.register_forward_pre_hook(pre)
    mon = None
    if monitored:
        cfg = write_config(tmp_path / "c.json", xy_distribution=True, all_xy=True, ops=OPS, ndigits=12)
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
    torch.manual_seed(1)
    for _ in range(2):
        refs.append({})
        model(torch.randn(5, 4)).backward()
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.close()
    return mon, refs


def test_a_nested_tensor_costs_the_dense_tensors_of_its_call_no_rows(tmp_path, monkeypatch):
    _, refs = _nested_run(tmp_path / "ref", monkeypatch, monitored=False)
    mon, _ = _nested_run(tmp_path / "mon", monkeypatch, monitored=True)
    grads = keyed(read_family(mon.run_dir, "actv_grad"))
    actv = keyed(read_family(mon.run_dir, "actv"))
    for step, ref in enumerate(refs):
        # two's dense input is emit's dense output: the same gradient and the same values
        for name in ("two.input_0", "emit.output_0"):
            row = grads.get((name, step, 0))
            assert row is not None, f"no actv_grad row {name} step {step}: {sorted(grads)}"
            assert math.isclose(float(row["norm"]), float(ref["grad"].norm()), rel_tol=1e-6), (name, row)
            assert math.isclose(float(row["max"]), float(ref["grad"].max()), rel_tol=1e-6), (name, row)
            row = actv[(name, step, 0)]
            assert math.isclose(float(row["norm"]), float(ref["value"].norm()), rel_tol=1e-6), (name, row)
        assert ("two.input_1", step, 0) not in grads and ("emit.output_1", step, 0) not in grads
    other = [k for k in mon.faults.counts if not k.startswith("unreadable tensor")]
    assert not other, dict(mon.faults.counts)


class ComplexModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, dtype=torch.complex64))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.fft.ifft(torch.fft.fft(self.fc(x)) * self.w).real)


def _complex_run(tmp_path, monkeypatch, steps: int = 3):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = ComplexModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = write_config(
        tmp_path / "c.json",
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        ops=OPS,
        ndigits=12,
    )
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    totals, grads = [], []
    for _ in range(steps):
        model(torch.randn(4, 8)).square().sum().backward()
        totals.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        grads.append(model.w.grad.detach().clone())
        opt.step()
        mon.flush()
        norms = mon.last_batch.derived.global_grad_norm
        totals[-1] = (totals[-1], norms)
        opt.zero_grad()
    mon.close()
    return mon, totals, grads


def test_a_complex_gradient_counts_in_the_global_norm_as_clip_grad_norm(tmp_path, monkeypatch):
    mon, totals, grads = _complex_run(tmp_path, monkeypatch)
    for want, got in totals:
        assert got is not None and math.isclose(got, want, rel_tol=1e-6), (got, want)
    rows = keyed(read_family(mon.run_dir, "grad_reduced"))
    for step, g in enumerate(grads):
        row = rows[("w", step, None)]
        moduli = g.abs().double()
        assert math.isclose(float(row["norm"]), float(moduli.norm()), rel_tol=1e-6), row
        assert float(row["nans"]) == 0
        # every statistic is the moduli's (a NaN min/max/mean fired AnomalyNan on every step)
        for op, want in (("min", moduli.min()), ("max", moduli.max())):  # float32 values, 12 digits written
            assert math.isclose(float(row[op]), float(want), rel_tol=1e-11), (op, row)
        assert math.isclose(float(row["mean"]), float(moduli.mean()), rel_tol=1e-6), row


def test_an_unreadable_gradient_without_ddp_makes_the_global_norm_nan(tmp_path, monkeypatch):
    """Without DDP the grad_reduced rows are copies of grad_unreduced's: a refused gradient there must
    still make the global norm NaN (it was silently low, without the refused tensor)."""
    from torch.testing._internal.two_tensor import TwoTensor  # a __torch_dispatch__ subclass: refused

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(write_config(tmp_path / "c.json", wg_distribution=True, ops=["norm"]))
    mon.set_monitor(model, optimizer=opt)
    model(torch.randn(2, 4)).sum().backward()
    g = model[1].weight.grad
    model[1].weight.grad = TwoTensor(g.clone(), g.clone())
    opt.step()
    mon.flush()
    assert math.isnan(mon.last_batch.derived.global_grad_norm), mon.last_batch.derived
    mon.close()


def test_a_refused_tensor_is_told_once_by_name_without_a_traceback(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        mon, _, _ = _complex_run(tmp_path, monkeypatch)
    told = [r for r in caplog.records if "unreadable tensor" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in told]  # three steps, four families: one line
    record = told[0]
    assert record.levelno == logging.WARNING and record.exc_info is None, record
    message = record.getMessage()
    assert "w (torch.complex64)" in message and "its rows are skipped" in message, message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert mon.faults.counts["unreadable tensor (complex tensor)"] >= 3  # still counted, every step


def test_a_gradient_that_could_not_be_read_makes_the_global_norm_nan(caplog):
    rows = tuple(RowMeta("grad_reduced", 0, name, None, (2,), torch.float32, 2) for name in ("a", "b", "c"))
    partials = empty_partials(3)
    partials[0, SUMSQ], partials[2, SUMSQ] = 9.0, 16.0
    partials[1, NANS] = math.nan  # `b`: a row a rank could not compute
    deriver = Deriver(FaultLog())
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        for step in range(2):
            batch = deriver(StepPayload(step, rows, partials.clone()))
            assert math.isnan(batch.derived.global_grad_norm), batch.derived
            assert [r.name for r in batch.rows] == ["a", "c"]
            assert np.allclose(batch.values["norm"], [3.0, 4.0])
    told = [r.getMessage() for r in caplog.records if "global_grad_norm" in r.getMessage()]
    assert len(told) == 1 and "b" in told[0], told
