"""Compiled (fullgraph) modules whose outputs hold a Parameter after an integer tensor in a dict, or nested
in a tuple (Megatron's skip_bias_add bias, wrapped), with actv_grad on: the traced hook rebuilds the output
by the same numbering as the rows (it crashed dynamo's trace); a module returning a custom object is said
once without logging inside the trace (it broke a fullgraph compile). References: the test's own tensor
hooks in an unmonitored eager run, float64 norms."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
import torch._dynamo
from torch import nn

from tests.helpers import compiled_grads, keyed, read_family, write_config
from trainermon import TrainerMon
from trainermon.runtime.probes import slots


class DictBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return {"ids": (x > 0).long(), "h": x @ self.w, "bias": self.b}


class NestBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x @ self.w, (x > 0).long(), [x + 1, (self.b,)]  # the bias two levels deep


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.d, self.n = DictBias(), NestBias()

    def forward(self, x):
        x = self.inp(x)
        o, p = self.d(x), self.n(x)
        return ((o["h"] + o["bias"]).square() * 2 + (p[0] + p[2][1][0]).square() + p[2][0] * 3).sum()


def _grad_norms(model: Model, x: torch.Tensor) -> dict[str, float]:
    """Reference: the gradients of the outputs, unmonitored and eager, by the documented numbering (a
    returned bias used once: its output's gradient is the parameter's)."""
    got: dict[str, float] = {}

    def keep(name, t):
        t.register_hook(lambda g: got.__setitem__(name, float(g.double().norm())))

    hd = model.d.register_forward_hook(lambda m, a, o: keep("d.output_1", o["h"]))

    def keep_n(module, args, out) -> None:  # (a hook returning a value would replace the output)
        keep("n.output_0", out[0])
        keep("n.output_3", out[2][0])

    hn = model.n.register_forward_hook(keep_n)
    model(x).backward()
    hd.remove()
    hn.remove()
    got["d.output_2"] = float(model.d.b.grad.double().norm())
    got["n.output_4"] = float(model.n.b.grad.double().norm())
    model.zero_grad()
    return got


def _run(tmp_path, sub: str, compiled: bool):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    ref = _grad_norms(model, x)
    cfg = write_config(tmp_path / f"{sub}.json", xy_distribution=True, all_xy=True, ops=["norm"], ndigits=12)
    mon = TrainerMon(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.set_monitor(model, optimizer=opt)
    fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    fn(x).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    mon.close()
    assert mon.faults.total == 0, dict(mon.faults.counts)
    rows = keyed(read_family(mon.run_dir, "actv_grad"))
    return ref, grads, rows


def test_compiled_parameter_after_int_and_nested(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    ref, eager_grads, eager = _run(tmp_path, "eager", compiled=False)
    _, grads, rows = _run(tmp_path, "compiled", compiled=True)
    names = ["d.output_1", "d.output_2", "n.output_0", "n.output_3", "n.output_4"]
    assert sorted(n for n, _, _ in eager if n[0] in "dn" and ".output" in n) == names
    assert len(ref) == 5
    for (name, _, _), row in eager.items():
        if name in ref:
            assert math.isclose(float(row["norm"]), ref[name], rel_tol=1e-6), (name, row["norm"], ref[name])
    want = compiled_grads(eager)
    assert sorted(rows) == sorted(want)
    for key, row in want.items():
        assert math.isclose(float(rows[key]["norm"]), float(row["norm"]), rel_tol=1e-5), key
    for n, g in eager_grads.items():
        torch.testing.assert_close(grads[n], g)


class Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class Wrap(nn.Module):
    def forward(self, x):
        return Holder(x * 2)


class HolderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.w = Wrap()

    def forward(self, x):
        return self.w(self.inp(x)).t.square().sum()


def test_custom_object_output_compiles_fullgraph(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setattr(slots, "_said_types", set())
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = HolderModel()
    x = torch.randn(3, 4)
    want = float(model.inp(x).detach().double().norm())
    cfg = write_config(tmp_path / "c.json", xy_distribution=True, all_xy=True, ops=["norm"], ndigits=12)
    mon = TrainerMon(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.set_monitor(model, optimizer=opt)
    fn = torch.compile(model, backend="aot_eager", fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        for _ in range(2):
            fn(x).backward()
            opt.step()
            opt.zero_grad()
            torch._dynamo.reset()  # a second trace: still said once
        mon.close()
    assert sum("a module returned a Holder" in r.getMessage() for r in caplog.records) == 1
    rows = keyed(read_family(mon.run_dir, "actv"))
    assert math.isclose(float(rows[("inp.output", 0, 0)]["norm"]), want, rel_tol=1e-6)
    assert not [k for k in rows if k[0].startswith("w.output")]


@pytest.mark.parametrize("out", [(torch.zeros(2), None), (torch.zeros(2), torch.ones(2), None)])
def test_flat_tuple_skips_dataclass_test(monkeypatch, out):
    calls = []
    real = dataclasses.is_dataclass
    monkeypatch.setattr(dataclasses, "is_dataclass", lambda o: calls.append(o) or real(o))
    assert slots.output_slots(out) == list(out)
    assert calls == []  # tensors and None: two isinstance tests, not the ~0.5 us dataclass test
