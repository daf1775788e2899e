"""The update-side families without a piece per tensor: `Adapter.read_whole` and `StepCollector.add_whole`
give the rows `read` and `add` give, in the same order, and plain PyTorch takes that path.

Tolerance of the value check: the native kernel's sum of squares is within 9.6e-7 of the float64 value
relative (the bound argued in `stats/_fused.c`); 2e-6 leaves a margin and still fails on a wrong tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers import write_config
from trainermon.collect.collector import StepCollector, TransferCounter
from trainermon.collect.placement import LOCAL, Sharded, TensorPiece
from trainermon.collect.records import StepScalars
from trainermon.stats import SUMSQ, EngineOptions, StatsEngine


def _tensors() -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(5, 7, generator=gen),
        None,  # a parameter without this tensor (no gradient yet): no row
        torch.randn(3, 4, generator=gen).t(),  # not contiguous, dense
        torch.randn(9, generator=gen).to(torch.bfloat16),
        torch.tensor(2.5),  # 0-d
        torch.randn(4, 4, generator=gen)[:, :2],  # not dense: the engine's general path
    ]


def _collector() -> StepCollector:
    return StepCollector(StatsEngine(EngineOptions(nonfinite=True)), TransferCounter())


@pytest.mark.parametrize("also_as", [None, "grad_reduced"])
def test_add_whole_gives_the_rows_of_add(also_as):
    tensors = _tensors()
    stages = [0, 0, 1, 1, 0, 1]
    names = [f"p{i}" for i in range(len(tensors))]
    other = torch.ones(3)  # rows added before and after keep their places
    by_pieces, by_whole = _collector(), _collector()
    for collector in (by_pieces, by_whole):
        collector.add("param_origin", [(0, "before", None, TensorPiece.whole(other))])
    entries = [
        (s, n, None, TensorPiece.whole(t, LOCAL)) for s, n, t in zip(stages, names, tensors) if t is not None
    ]
    by_pieces.add("grad_unreduced", entries, also_as=also_as)
    by_whole.add_whole("grad_unreduced", stages, names, tensors, LOCAL, also_as=also_as)
    for collector in (by_pieces, by_whole):
        collector.add("param_origin", [(0, "after", None, TensorPiece.whole(other))])
    # each row's place in the order of adds, by which `finish` puts merged sharded rows back among them
    assert by_whole._order == by_pieces._order and by_whole._next == by_pieces._next
    want = by_pieces.finish(0, StepScalars())
    got = by_whole.finish(0, StepScalars())
    assert got.rows == want.rows
    assert len(got.rows) == 2 + 5 * (2 if also_as else 1)
    assert torch.equal(got.partials, want.partials)
    for i, row in enumerate(got.rows):  # each row against its own tensor, in float64
        if row.family == "grad_unreduced":
            t = tensors[names.index(row.name)]
            assert row.shape == tuple(t.shape) and row.dtype == t.dtype and row.numel == t.numel()
            exact = float(t.double().square().sum())
            assert math.isclose(float(got.partials[i, SUMSQ]), exact, rel_tol=2e-6), (row.name, exact)


def test_add_whole_refuses_a_sharded_placement():
    with pytest.raises(ValueError, match="sharded"):
        _collector().add_whole("grad_reduced", [0], ["w"], [torch.ones(2)], Sharded(None))


def _trained(tmp_path, config: dict):
    from trainermon import TrainerMon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = TrainerMon(write_config(tmp_path / "c.json", **config))
    monitor.set_monitor(model, optimizer=opt)
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    return monitor, model, opt


def test_torch_adapter_reads_whole_what_it_reads_as_pieces(tmp_path):
    from trainermon.adapters.base import GRAD_REDUCED, GRAD_UNREDUCED, PARAM

    monitor, _, _ = _trained(tmp_path, {"wg_distribution": True})
    adapter, params = monitor.loop.adapter, monitor.loop.selection.params
    for kind in (GRAD_REDUCED, PARAM, "exp_avg", "exp_avg_sq"):
        placement, tensors = adapter.read_whole(kind, params)
        pieces = adapter.read(kind, params)
        assert len(tensors) == len(pieces) == 4
        for t, piece in zip(tensors, pieces):
            assert piece.placement == placement and piece.full_shape == tuple(t.shape)
            assert t.data_ptr() == piece.tensor.data_ptr() and torch.equal(t, piece.tensor)
    assert adapter.read_whole(GRAD_UNREDUCED, params) is None  # the pre-reduce reads have their own rule
    monitor.close()


def test_plain_pytorch_records_the_update_side_without_pieces(tmp_path, monkeypatch):
    """Every parameter family of a collected step goes through `add_whole`, none through `add`."""
    monitor, model, opt = _trained(
        tmp_path, {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
    )
    collector = monitor.loop.collector
    calls = {"add": [], "add_whole": []}
    for name in calls:
        method = getattr(collector, name)

        def spy(family, *args, _method=method, _name=name, **kwargs):
            calls[_name].append(family)
            return _method(family, *args, **kwargs)

        monkeypatch.setattr(collector, name, spy)
    opt.zero_grad()
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    monitor.close()
    assert calls["add"] == []
    assert sorted(calls["add_whole"]) == sorted(
        ["grad_unreduced", "param_origin", "exp_avg", "exp_avg_sq", "param_updated"]
    )
