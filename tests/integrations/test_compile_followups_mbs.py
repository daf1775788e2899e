"""Compiled autograd (`compiled_autograd = True`, forward and backward inside one `@torch.compile` step) with
monitor_mbs_grad: dynamo traces the parameters' eager micro-batch hooks into the backward it compiles. Traced,
the collector's bookkeeping (`len(self._metas._rows)`) guarded the graph, which recompiled at each new row
until the recompile limit. The hook reports outside the trace: nothing compiles again once every graph of
the step exists, and each micro-batch's row equals the gradient an eager copy computes for that batch."""

from __future__ import annotations

import copy
import gc
import os
import types

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_monitor_functions() -> dict[str, int]:
    """The monitor's functions that dynamo compiled, with their number of compiled versions."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    import trainermon.adapters

    where = (os.path.dirname(trainermon.__file__), os.path.dirname(trainermon.adapters.__file__))
    found: dict[str, int] = {}
    for obj in gc.get_objects():
        if type(obj) is types.FunctionType and obj.__code__.co_filename.startswith(where):
            entries = len(_debug_get_cache_entry_list(obj.__code__))
            if entries:
                found[obj.__qualname__] = entries
    return found


def test_compiled_autograd_microbatch_hooks_do_not_recompile(tmp_path, monkeypatch):
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = write_config(
        tmp_path / "c.json", wg_distribution=True, monitor_mbs_grad=True, ops=list(OPS), ndigits=12
    )
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt, grad_acc_steps=2)

    gen = torch.Generator().manual_seed(1)
    expected: dict[tuple, dict[str, float]] = {}
    with torch._dynamo.config.patch(compiled_autograd=True):

        @torch.compile(backend="aot_eager")
        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().sum()
            loss.backward()
            return loss

        for s in range(4):
            for micro in range(2):
                x = torch.randn(3, 4, generator=gen)
                step(x)
                reference.zero_grad()
                reference(x).square().sum().backward()  # this micro-batch's own gradient
                for name, p in reference.named_parameters():
                    expected[(name, s, micro)] = ref_stats(p.grad)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, q in zip(reference.parameters(), model.parameters()):
                    p.copy_(q)
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    # traced, the monitor's own functions were compiled (StepCollector.add up to the recompile limit, 8)
    assert _compiled_monitor_functions() == {}

    rows = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    assert set(rows) == set(expected)
    for key, row in rows.items():
        assert_row_matches(row, expected[key], OPS)
