"""Compiled autograd (`torch._dynamo.config.compiled_autograd = True`) with forward and backward inside one
`@torch.compile` train step, as torch's compiled-autograd tutorial writes it, with actv_grad on: the graph
taps' gradient hooks are traced into the backward that compiled autograd re-traces, where a hook's result
is what flows on (a hook returning None failed the compile at step 0).

The reference is an eager copy of the model fed the same batches, its activations' gradients taken with
`retain_grad()`: training must be unchanged (same losses, same weights) and every row equal to it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config
from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH

OPS = ("norm", "mean", "min", "max")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _reference_step(model: nn.Module, x: torch.Tensor, step: int, out: dict) -> float:
    """One eager step of the copy; out gets the reference statistics of every row the monitor writes."""
    h0 = model[0](x)
    h1 = model[1](h0)
    y = model[2](h1)
    for t in (h0, h1, y):
        t.retain_grad()
    loss = y.square().sum()
    loss.backward()
    acts = {"0.input": x, "0.output": h0, "1.input": h0, "1.output": h1, "2.input": h1, "2.output": y}
    for name, t in acts.items():
        out[("actv", name, step)] = ref_stats(t)
        if name != "0.input":  # the batch needs no gradient
            out[("actv_grad", name, step)] = ref_stats(t.grad)
    for name, p in model.named_parameters():
        out[("grad_unreduced", name, step)] = ref_stats(p.grad)
    return loss.item()


@pytest.mark.skipif(not HOOKS_IN_GRAPH, reason="this torch traces no tensor hooks into graphs")
def test_compiled_autograd_step_with_actv_grad_trains_and_writes_right_rows(tmp_path, monkeypatch):
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    cfg = write_config(
        tmp_path / "c.json", xy_distribution=True, wg_distribution=True, ops=list(OPS), ndigits=12
    )
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)

    gen = torch.Generator().manual_seed(1)
    expected: dict[tuple, dict[str, float]] = {}
    # set before torch.compile wraps the step (a patch around the calls alone was not seen: no compiled
    # autograd, and the old hook passed)
    with torch._dynamo.config.patch(compiled_autograd=True):

        @torch.compile(backend="aot_eager")
        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().sum()
            loss.backward()
            return loss

        for s in range(3):
            x = torch.randn(3, 4, generator=gen)
            loss = step(x).item()
            assert loss == pytest.approx(_reference_step(reference, x, s, expected), rel=1e-6)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)  # training unchanged by the monitor

    for family in ("actv", "actv_grad", "grad_unreduced"):
        rows = {(n, s): r for (n, s, _), r in keyed(read_family(monitor.run_dir, family)).items()}
        want = {(n, s): v for (f, n, s), v in expected.items() if f == family}
        assert set(rows) == set(want), family
        for key, row in rows.items():
            assert_row_matches(row, want[key], OPS)
