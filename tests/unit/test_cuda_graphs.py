"""CUDA graphs the user captures (`torch.cuda.graph`, as Megatron's CUDA-graph option does per layer): a
graph's replays run kernels, not the monitor's hooks, and a capture runs the hooks once on buffers that
only replays fill. The monitor records nothing while a capture is under way (a tensor held by reference
would be read after some replay, or before any, as uninitialised memory) and says so once; the capture and
its replays are the model's own, and the eager calls around them keep their rows.
(`mode="reduce-overhead"` in torch.compile is `test_graph_taps.py::test_cuda_graphs_record_every_step`.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon


def _two_steps(tmp_path, device: str, capture: Callable[[nn.Module, torch.Tensor], torch.Tensor], caplog):
    """Two training steps of a small model with actv rows; step 1 also makes a reference call, two
    warm-up calls and `capture`. Checks the captured output, the rows (every eager call's, not the
    capture's) and that the refusal was counted and logged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "c.json", xy_distribution=True, ops=["norm"]))
    monitor.set_monitor(model, optimizer=opt)
    x = torch.randn(4, 8, device=device)
    want = []  # the output norm of each step's weights (every call of a step sees the same weights)
    for step in range(2):
        with torch.no_grad():
            want.append(float(model(x).double().norm()))
        if step == 1:
            with caplog.at_level("ERROR", logger="trainermon"), torch.no_grad():
                captured = capture(model, x)
            assert float(captured.double().norm()) == pytest.approx(want[1], rel=1e-6)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert monitor.loop.faults.total > 0
    assert any("CUDA graph is being captured" in r.getMessage() for r in caplog.records)
    rows = keyed(read_family(monitor.run_dir, "actv"))
    calls = {0: 2, 1: 4}  # step 1: the reference, two warm-up calls and the training call (not the capture)
    for step, count in calls.items():
        norms = [float(row["norm"]) for key, row in rows.items() if key[0] == "2.output" and key[1] == step]
        assert len(norms) == count, (step, norms)
        assert norms == pytest.approx([want[step]] * count, rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no CUDA device on this machine")
def test_a_capture_records_nothing_and_says_so(tmp_path, out_dir, caplog):
    def capture(model: nn.Module, x: torch.Tensor) -> torch.Tensor:  # as torch.cuda.graph's docs do it
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        graph.replay()
        torch.cuda.synchronize()
        return out

    _two_steps(tmp_path, "cuda", capture, caplog)


def test_the_refusal_is_contained_and_said_once(tmp_path, out_dir, caplog, monkeypatch):
    """The same on the CPU, where no graph can be captured: a stand-in for the GPU. `engine.capturing`, the
    one runtime query, answers True while `capturing` is set; everything after it (the checks, the hooks
    containing the refusal, the log, the rows of the other calls) is the real code."""
    from trainermon.stats import engine

    capturing: list[bool] = []
    monkeypatch.setattr(engine, "capturing", lambda: bool(capturing))

    def capture(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            model(x)
        capturing.append(True)
        try:
            return model(x)
        finally:
            capturing.clear()

    _two_steps(tmp_path, "cpu", capture, caplog)


def test_a_captured_optimizer_step_records_nothing(tmp_path, out_dir, caplog, monkeypatch):
    """An optimizer step captured into a graph (capturable optimizers allow it): the same stand-in for the
    GPU, now around `opt.step()`, where the monitor's optimizer hooks read gradients, moments and
    parameters and end the step (a transfer, collectives). That step writes no rows at all (its eager
    activation rows are dropped with it), the refusal is logged, and the steps around it keep theirs."""
    from trainermon.stats import engine

    capturing: list[bool] = []
    monkeypatch.setattr(engine, "capturing", lambda: bool(capturing))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    config = write_config(
        tmp_path / "c.json",
        xy_distribution=True,
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        ops=["norm"],
    )
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=opt)
    x = torch.randn(4, 8)
    want = []  # the last layer's gradient norm, step by step
    for step in range(3):
        model(x).sum().backward()
        want.append(float(model[2].weight.grad.double().norm()))
        if step == 1:
            capturing.append(True)
        with caplog.at_level("ERROR", logger="trainermon"):
            opt.step()
        capturing.clear()
        opt.zero_grad()
    monitor.close()
    assert monitor.loop.faults.total > 0
    assert any("CUDA graph is being captured" in r.getMessage() for r in caplog.records)
    names = {
        "actv": "2.output",
        "grad_reduced": "2.weight",
        "exp_avg": "2.weight",
        "param_origin": "2.weight",
    }
    for family, name in names.items():
        steps = sorted({key[1] for key in keyed(read_family(monitor.run_dir, family)) if key[0] == name})
        assert steps == [0, 2], (family, steps)
    grads = keyed(read_family(monitor.run_dir, "grad_reduced"))
    for step in (0, 2):
        [row] = [row for key, row in grads.items() if key[0] == "2.weight" and key[1] == step]
        assert float(row["norm"]) == pytest.approx(want[step], rel=1e-5)
