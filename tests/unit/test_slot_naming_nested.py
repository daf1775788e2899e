"""Output numbering of dict outputs with integer tensors and of nested containers (nn.LSTM's
(out, (h_n, c_n)), a tuple holding a dict, a dataclass output): every tensor value is numbered, integer
ones get no row; a nested container keeps its number with no row (never msprobe's NaN row) and its tensors
follow the top-level elements, with their gradients. References: the test's own forward hooks and tensor
hooks, float64 norms."""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon


@dataclasses.dataclass
class Out:
    h: torch.Tensor
    ids: torch.Tensor


class Tup(nn.Module):
    def forward(self, x):
        return x * 2, (x > 0).long(), x * 3


class Dct(nn.Module):
    def forward(self, x):
        return {"a": x * 2, "ids": (x > 0).long(), "b": x * 3}


class Dct1(nn.Module):
    def forward(self, x):
        return {"a": x * 2, "ids": (x > 0).long()}


class Nest(nn.Module):
    def forward(self, x):
        return x * 2, {"p": x * 4, "q": (x * 5, None)}, x * 6


class Dc(nn.Module):
    def forward(self, x):
        return Out(x * 7, (x > 0).long())


class DctNest(nn.Module):
    def forward(self, x):  # numbered as the tuple (x * 2, (x * 3, x * 4)) is (a review found 0, 1, 2)
        return {"a": x * 2, "nest": (x * 3, x * 4), "none": None}


class Fn(nn.Module):
    def forward(self, x):  # Megatron's IdentityFuncOp returns a function: no tensor, nothing to say
        return torch.nn.functional.relu


class Odd(nn.Module):
    def forward(self, x):
        return {x * 8}  # a set: not read, said once


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lstm = nn.LSTM(4, 4, batch_first=True)
        self.tup, self.dct, self.dct1 = Tup(), Dct(), Dct1()
        self.nest, self.dc, self.odd = Nest(), Dc(), Odd()
        self.dnest, self.fn = DctNest(), Fn()

    def forward(self, x):
        x = self.lin(x)
        o, (h, c) = self.lstm(x)
        a, b, c1 = self.tup(o), self.dct(o), self.dct1(o)
        n, d = self.nest(o), self.dc(o)
        self.odd(o)
        self.fn(o)
        dn = self.dnest(o)
        loss = (a[0] * 1.5 + a[2]).sum() + (b["a"] + b["b"] * 2 + c1["a"]).pow(2).sum()
        loss = loss + (n[0] + n[1]["p"] * 3 + n[1]["q"][0] + n[2]).sum() + d.h.pow(2).sum()
        loss = loss + (dn["a"] + 2 * dn["nest"][0] + 3 * dn["nest"][1]).pow(2).sum()
        return loss + h.pow(2).sum() + 3 * c.sum() + o.sum()


def flat(out):
    """The test's own reading of the documented order: top-level tensors, then nested ones depth first."""
    if dataclasses.is_dataclass(out):
        return [getattr(out, f.name) for f in dataclasses.fields(out)]
    if isinstance(out, dict):  # tensors and containers numbered in order, other values skipped
        out = [v for v in out.values() if isinstance(v, (torch.Tensor, tuple, list, dict))]
    top = [t if isinstance(t, torch.Tensor) else None for t in out]

    def walk(o):
        if isinstance(o, torch.Tensor):
            return [o]
        if isinstance(o, (tuple, list)):
            return [t for i in o for t in walk(i)]
        if isinstance(o, dict):
            return [t for i in o.values() for t in walk(i)]
        return []

    return top + [t for o in out if isinstance(o, (tuple, list, dict)) for t in walk(o)]


def test_dict_and_nested_outputs(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", xy_distribution=True, all_xy=True, ops=["norm"], ndigits=12)
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt, grad_acc_steps=1)
    actv, grads = {}, {}

    def own(name):
        def hook(module, args, output):
            for i, t in enumerate(flat(output)):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    actv[f"{name}.output_{i}"] = float(t.detach().double().norm())
                    t.register_hook(lambda g, k=f"{name}.output_{i}": grads.__setitem__(k, float(g.norm())))

        return hook

    for name in ("lstm", "tup", "dct", "dct1", "nest", "dc", "dnest"):
        getattr(model, name).register_forward_hook(own(name))
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        model(torch.randn(2, 3, 4)).backward()
        opt.step()
        mon.close()
    assert mon.faults.total == 0, dict(mon.faults.counts)
    got = {n: float(r["norm"]) for (n, _, _), r in keyed(read_family(mon.run_dir, "actv")).items()}
    got_g = {n: float(r["norm"]) for (n, _, _), r in keyed(read_family(mon.run_dir, "actv_grad")).items()}
    outs = {n: v for n, v in got.items() if ".output" in n and not n.startswith(("lin", "odd", "fn"))}
    # integer tensors and nested containers keep their number but get no row; nothing is NaN
    assert (
        sorted(outs)
        == sorted(actv)
        == [
            "dc.output_0",
            "dct.output_0",
            "dct.output_2",
            "dct1.output_0",
            "dnest.output_0",
            "dnest.output_2",
            "dnest.output_3",
            "lstm.output_0",
            "lstm.output_2",
            "lstm.output_3",
            "nest.output_0",
            "nest.output_2",
            "nest.output_3",
            "nest.output_4",
            "tup.output_0",
            "tup.output_2",
        ]
    )
    for name, ref in actv.items():
        assert math.isclose(outs[name], ref, rel_tol=1e-6), (name, outs[name], ref)
    grad_outs = {n: v for n, v in got_g.items() if n in actv}
    assert sorted(grad_outs) == sorted(grads)
    for name, ref in grads.items():
        assert math.isclose(grad_outs[name], ref, rel_tol=1e-6), (name, grad_outs[name], ref)
    assert not [n for n in got if n.startswith("odd.output")]
    assert sum("a module returned a set" in r.getMessage() for r in caplog.records) == 1
    assert not [
        r for r in caplog.records if "returned a builtin" in r.getMessage() or "function" in r.getMessage()
    ]
