"""Shared by the test_graph_taps*.py modules: the model, eager/compiled training runs, row comparisons."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon
from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH

OPS = ("norm", "min", "max")
# On a torch whose dynamo cannot trace tensor hooks (older than 2.12: torch 2.11 on the GPU host in
# session 30), compiled modules write actv rows and no actv_grad rows, by design and said once (README,
# test_a_torch_without_traced_tensor_hooks_writes_no_gradient_rows_in_graphs). Tests about gradient rows
# from inside graphs and nothing else are skipped there; the others check their actv rows all the same.
needs_traced_hooks = pytest.mark.skipif(
    not HOOKS_IN_GRAPH, reason="this torch (older than 2.12) writes no actv_grad rows from compiled graphs"
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


class Mix(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, *, gate: torch.Tensor) -> tuple:
        return a * torch.sigmoid(b), None, (gate > 0).long(), a + gate


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict:
        return {"p": self.p(x), "q": torch.tanh(x)}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.mix, self.heads = nn.Linear(8, 8), nn.Linear(8, 8), Mix(), Heads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))  # b's input is no module's output: a buffer of its own
        mixed, _, _, skip = self.mix(h, h, gate=x)
        heads = self.heads(mixed)
        return heads["p"] * heads["q"] + skip


def _same_rows(got: dict, want: dict, abs_tol: float = 1e-6) -> None:
    assert set(got) == set(want) and want, sorted(set(got) ^ set(want))[:8]
    for key, row in want.items():
        for op in OPS:
            expected, actual = float(row[op]), float(got[key][op])
            if math.isnan(expected):
                assert math.isnan(actual), (key, op, actual)
            else:
                assert actual == pytest.approx(expected, rel=1e-4, abs=abs_tol), (key, op)


def _same_grad_rows(got: dict, want: dict, outside=lambda key: False, **tolerances) -> None:
    """actv_grad rows of a compiled run against the eager run's (`want`, never empty). Where dynamo cannot
    trace tensor hooks, only the rows of modules whose hooks ran outside the graphs (`outside(key)`) are
    written, and no other."""
    assert want
    if not HOOKS_IN_GRAPH:
        want = {key: row for key, row in want.items() if outside(key)}
        if not want:
            assert got == {}, sorted(got)[:8]
            return
    _same_rows(got, want, **tolerances)


def _train_rows(
    tmp_path,
    tag: str,
    make_model,
    backend: str | None,
    *,
    steps: int = 2,
    fullgraph: bool = False,
    input_grad: bool = False,
    **config,
) -> tuple[dict, dict, int, int]:
    """`make_model()` trained `steps` steps on (4, 8) inputs, eagerly (`backend` None) or compiled, with
    actv and actv_grad monitored: (actv rows, actv_grad rows, faults, graph breaks)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = write_config(tmp_path / f"{tag}{backend}.json", xy_distribution=True, ops=list(OPS), **config)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=fullgraph)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        run(torch.randn(4, 8, generator=gen, requires_grad=input_grad)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return (
        keyed(read_family(monitor.run_dir, "actv")),
        keyed(read_family(monitor.run_dir, "actv_grad")),
        monitor.loop.faults.total,
        sum(counters["graph_break"].values()),
    )
