"""actv and actv_grad under torch.compile when the first collected step comes after the first compiled
forward. backend="aot_eager" (dynamo + AOT autograd, no inductor codegen) keeps the test fast on CPU; the
hooks' placement in the graph is dynamo's doing, the same for every backend.

The compiled and eager runs do the same float32 operations (aot_eager runs the traced aten ops eagerly),
so values agree to float32 reduction rounding; rel 1e-5 is well above it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import compiled_grads, keyed, read_family, write_config
from trainermon import TrainerMon
from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH

OPS = ("norm", "min", "max")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo's caches and counters are per process: leave none behind for later tests (the monitor warns
    at set_monitor when graphs were compiled before it)."""
    yield
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _run(tmp_path, tag: str, compiled: bool, steps: int, **config) -> tuple[dict, dict, list[int]]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = write_config(tmp_path / f"{tag}.json", xy_distribution=True, ops=list(OPS), **config)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    gen = torch.Generator().manual_seed(1)
    graphs = []
    for _ in range(steps):
        run(torch.randn(3, 4, generator=gen)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    monitor.close()
    return (
        keyed(read_family(monitor.run_dir, "actv")),
        keyed(read_family(monitor.run_dir, "actv_grad")),
        graphs,
    )


@pytest.mark.parametrize(
    "config,first",
    [({"start_step": 2}, 2), ({"step_interval": 2, "start_step": 1}, 1)],
    ids=["start_step", "step_interval"],
)
def test_compiled_model_collects_late_steps(tmp_path, out_dir, config, first):
    want_actv, want_grad, _ = _run(tmp_path, "eager", False, 6, **config)
    got_actv, got_grad, graphs = _run(tmp_path, "compiled", True, 6, **config)
    assert {step for _, step, _ in want_grad} >= {first} and want_actv
    for got, want in ((got_actv, want_actv), (got_grad, compiled_grads(want_grad))):
        assert set(got) == set(want)
        for key, row in want.items():
            for op in OPS:
                assert float(got[key][op]) == pytest.approx(float(row[op]), rel=1e-5, abs=1e-7), (key, op)
    # compiled once before the first collected step; the collected step's variant compiled once then
    # (with graph breaks around the hooks); nothing compiled after it, collected or not
    assert len(set(graphs[:first])) == 1
    assert graphs[first] > graphs[first - 1]
    assert set(graphs[first + 1 :]) == {graphs[first]}, graphs


def test_compiled_model_dynamic_switch_on_later(tmp_path, out_dir, dynamic_mode):
    """DYNAMIC_MONITOR: collection switched on by a config edit after the model has compiled and run."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tests.unit.test_dynamic import _wait_dirty
    from trainermon.runtime.control import update_config_file

    torch._dynamo.reset()
    counters.clear()
    path = tmp_path / "monitor_config.json"
    path.write_text('{"xy_distribution": true, "ops": ["norm"], "dynamic_on": false, "collect_times": 100}')
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(str(path))
    monitor.set_monitor(model, optimizer=opt)
    compiled = torch.compile(model, backend="aot_eager")
    outputs, graphs = [], []
    for i in range(5):
        if i == 2:
            update_config_file(str(path), dynamic_on=True)
            _wait_dirty(monitor)
        out = compiled(torch.ones(3, 4) * (i + 1))
        outputs.append(out.detach().clone())
        out.square().sum().backward()
        opt.step()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    monitor.close()
    actv = keyed(read_family(monitor.run_dir, "actv"))
    grads = keyed(read_family(monitor.run_dir, "actv_grad"))
    steps = {step for _, step, _ in actv}
    assert steps and min(steps) >= 2, steps
    first = min(steps)
    # the last Linear's output is the model's output: its actv row equals the compiled output's norm
    row = actv[("2.output", first, 0)]
    assert float(row["norm"]) == pytest.approx(float(outputs[first].double().norm()), rel=1e-5)
    # and its gradient is d(sum out^2)/d out = 2 out (none from the graph on a torch older than 2.12)
    if HOOKS_IN_GRAPH:
        grad_row = grads[("2.output", first, 0)]
        assert float(grad_row["norm"]) == pytest.approx(2 * float(outputs[first].double().norm()), rel=1e-5)
    else:
        assert grads == {}
    assert set(graphs[first + 1 :]) == {graphs[first]}, graphs


def test_compiled_before_set_monitor_recompiles_once(tmp_path, out_dir, caplog):
    """A model compiled and run before set_monitor: the monitor resets dynamo's caches once, the compiled
    model recompiles once with the hooks, and its actv/actv_grad rows equal the eager run's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rows = {}
    for compiled in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        gen = torch.Generator().manual_seed(1)

        def step(run=run, gen=gen, opt=opt) -> None:
            run(torch.randn(3, 4, generator=gen)).square().sum().backward()
            opt.step()
            opt.zero_grad()

        step()
        step()  # trained (and compiled) before the monitor exists
        before = counters["stats"]["unique_graphs"]
        monitor = TrainerMon(
            write_config(tmp_path / f"c{compiled}.json", xy_distribution=True, ops=list(OPS))
        )
        with caplog.at_level("INFO", logger="trainermon"):
            monitor.set_monitor(model, optimizer=opt)
        graphs = []
        for _ in range(4):
            step()
            graphs.append(counters["stats"]["unique_graphs"])
        monitor.close()
        rows[compiled] = (
            keyed(read_family(monitor.run_dir, "actv")),
            keyed(read_family(monitor.run_dir, "actv_grad")),
        )
        if compiled:
            assert before >= 1 and graphs[0] > before and set(graphs) == {graphs[0]}, (before, graphs)
            assert any("recompiles once" in r.message for r in caplog.records)
    assert all(len({s for _, s, _ in eager}) == 4 for eager in rows[False])
    for got, want in zip(rows[True], (rows[False][0], compiled_grads(rows[False][1]))):
        assert set(got) == set(want)
        for key, row in want.items():
            for op in OPS:
                assert float(got[key][op]) == pytest.approx(float(row[op]), rel=1e-5, abs=1e-7), (key, op)


@pytest.mark.parametrize("first", [2, 0])
def test_block_compiled_on_its_own(tmp_path, out_dir, caplog, first):
    """A submodule compiled by itself (`module.compile()`, as torchtitan compiles each block); its root
    runs eagerly, so the trace is not seen by the root's watcher.

    - first=2: traced on a step that collects nothing, so the graph has no hooks. The next collected step
      sees dynamo's graph count moved, resets its caches once (logged) and keeps the hooks from then on.
    - first=0: traced on a collected step, while the hooks are installed but not pinned: the first hook
      dynamo traces pins them and makes the hooks that dynamo traces (`HookedModule.traced_pre` and
      `traced_forward`), so the block's graph calls the tap operators.

    Either way the rows equal the eager run's, and no hook fails. The eager run never makes the traced
    hooks (memory that nothing would use)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    class Block(nn.Module):  # a model's own block (dynamo does not trace torch's modules as a top frame)
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.proj(x))

    rows = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(Block(), nn.Linear(8, 2))
        if compiled:
            model[0].compile(backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(
            write_config(
                tmp_path / f"b{compiled}.json", xy_distribution=True, ops=list(OPS), start_step=first
            )
        )
        monitor.set_monitor(model, optimizer=opt)
        gen = torch.Generator().manual_seed(1)
        hooked = []
        with caplog.at_level("INFO", logger="trainermon"):
            for _ in range(5):
                hooked.append(bool(model[0].proj._forward_hooks))
                model(torch.randn(3, 4, generator=gen)).square().sum().backward()
                opt.step()
                opt.zero_grad()
        probe = monitor.loop.probes[1]  # before close(), which drops the probes with the model
        monitor.close()
        rows[compiled] = (
            keyed(read_family(monitor.run_dir, "actv")),
            keyed(read_family(monitor.run_dir, "actv_grad")),
        )
        assert hooked == [i >= first for i in range(5)], hooked
        assert monitor.loop.faults.total == 0
        traced = [h for m in probe._hooked.values() for h in (m.traced_pre, m.traced_forward)]
        assert len(traced) == 2 * len(probe.modules) > 0
        if compiled:
            assert counters["stats"]["unique_graphs"] >= 1
            assert probe.hooks.pinned and all(traced)
            if first:
                assert sum("recompiles once" in r.message for r in caplog.records) == 1
        else:
            assert not probe.hooks.pinned and probe._taps is None and not any(traced)
    assert all({s for _, s, _ in eager} == set(range(first, 5)) for eager in rows[False])

    def outside(key: tuple) -> bool:  # the block's own hooks run outside its compiled forward
        return not key[0].startswith("0.proj.")

    for got, want in zip(rows[True], (rows[False][0], compiled_grads(rows[False][1], outside))):
        assert set(got) == set(want)
        for key, row in want.items():
            for op in OPS:
                assert float(got[key][op]) == pytest.approx(float(row[op]), rel=1e-5, abs=1e-7), (key, op)


def test_trace_watcher_adds_no_graph_break(tmp_path, out_dir):
    """The roots' trace watcher pins the hooks from inside dynamo's trace without a graph break: a model
    compiled with fullgraph=True (where any break is an error) runs its steps that collect nothing, as one
    graph, with the hooks installed from its first trace on."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "c.json", xy_distribution=True, ops=["norm"], start_step=50))
    monitor.set_monitor(model, optimizer=opt)
    assert not model[0]._forward_hooks  # eager so far: no hooks on a step that collects nothing
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        run(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        assert model[0]._forward_hooks and model[2]._forward_pre_hooks  # pinned at the first trace
    monitor.close()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert monitor.faults.total == 0


@pytest.mark.parametrize("closure", [False, True], ids=["step()", "step(closure)"])
def test_a_compiled_optimizer_step_is_one_step_each(tmp_path, out_dir, closure):
    """`torch.compile` of a function that calls `opt.step()`: dynamo traced the monitor's step hooks
    (torch 2.11: a guard assertion, only step 0 written; 2.13: a warning per compile for the stack walk
    that tells nested step() calls apart). The hooks now run outside the graph."""
    import warnings

    cfg = write_config(tmp_path / "c.json", wg_distribution=True, ops=["norm"])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)

    x = torch.ones(3, 4)

    def loss_backward() -> torch.Tensor:
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    @torch.compile(backend="eager")
    def step() -> None:
        opt.step(loss_backward) if closure else opt.step()  # the closure runs inside the compiled step

    grads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            x = torch.full((3, 4), float(i + 1))
            if not closure:
                loss_backward()
                grads.append(float(model[0].weight.grad.double().norm()))
            step()
            if closure:
                grads.append(float(model[0].weight.grad.double().norm()))
            opt.zero_grad()
        monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    traced = [str(w.message) for w in caught if any(k in str(w.message) for k in ("_getframe", "trainermon"))]
    assert not traced, traced
    rows = [r for r in read_family(monitor.run_dir, "grad_reduced") if r["name"] == "0.weight"]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    for row, want in zip(rows, grads):  # float32 norm of 32 float32 values: ~1e-7 relative
        assert float(row["norm"]) == pytest.approx(want, rel=1e-5)
