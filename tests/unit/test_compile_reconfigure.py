"""Config edits under torch.compile once the activation hooks are pinned: switching the activation families
off and back on keeps the hooks (no reset of dynamo's caches: a function the user compiled on its own is
not compiled again), and an evaluation pass (eval(), no_grad) compiles one graph whatever the monitor's
flags are (no graph per family switch towards dynamo's recompile_limit). backend="aot_eager", as in
test_compile.py: the rows equal an eager run's to float32 reduction rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import compiled_grads, keyed, read_family
from tests.unit.test_dynamic import _wait_dirty
from trainermon import TrainerMon
from trainermon.runtime.control import update_config_file

OPS = ("norm", "min", "max")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _counting_backend(calls: list[int]):
    import torch._dynamo

    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        calls.append(1)
        return aot_eager(gm, example_inputs)

    return backend


def _families(tmp_path, compiled: bool, edits: dict[int, dict], steps: int, eval_pass: bool = False):
    """`steps` steps with batch sizes that vary (dynamo's automatic dynamic shapes); `edits[i]` saved and
    seen before step i. Returns (actv rows, actv_grad rows, graphs after each step, compiles of the user's
    own loss function, the model's outputs, graphs compiled by the evaluation passes)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    path = tmp_path / f"cfg_{compiled}.json"
    path.write_text(
        '{"xy_distribution": true, "wg_distribution": true, "ops": ["norm", "min", "max"],'
        ' "dynamic_on": true, "collect_times": 1000}'
    )
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(str(path))
    monitor.set_monitor(model, optimizer=opt)
    loss_compiles: list[int] = []

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().sum()

    run = torch.compile(model, backend="aot_eager") if compiled else model
    loss = torch.compile(loss_fn, backend=_counting_backend(loss_compiles)) if compiled else loss_fn
    gen = torch.Generator().manual_seed(1)
    graphs, outputs, eval_graphs = [], [], 0
    for i in range(steps):
        if i in edits:
            update_config_file(str(path), **edits[i])
            _wait_dirty(monitor)
        out = run(torch.randn(3 + i % 3, 4, generator=gen))
        outputs.append(out.detach().clone())
        loss(out).backward()
        opt.step()
        opt.zero_grad()
        if eval_pass:
            before = counters["stats"]["unique_graphs"]
            model.eval()
            with torch.no_grad():
                run(torch.randn(3 + i % 3, 4, generator=gen))
            model.train()
            eval_graphs += counters["stats"]["unique_graphs"] - before
        graphs.append(counters["stats"]["unique_graphs"])
    monitor.close()
    actv = keyed(read_family(monitor.run_dir, "actv"))
    grads = keyed(read_family(monitor.run_dir, "actv_grad"))
    return actv, grads, graphs, len(loss_compiles), outputs, eval_graphs


def _same_rows(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, row in want.items():
        for op in OPS:
            assert float(got[key][op]) == pytest.approx(float(row[op]), rel=1e-5, abs=1e-7), (key, op)


def test_families_off_and_on_keep_the_pinned_hooks(tmp_path, out_dir, dynamic_mode, caplog):
    """`trainermon on --families grad_reduced`, then actv and actv_grad again: the pinned hooks stay (a
    guarded recompile of the model's graph when off, the cached one when on again), so the user's own
    compiled loss function is not compiled again; rows as an eager run's with the same edits."""
    off = {"xy_distribution": False}
    on = {"xy_distribution": True}
    edits = {4: off, 7: on, 10: off, 12: on}
    want_actv, want_grad, _, _, eager_out, _ = _families(tmp_path, False, edits, 14)
    got_actv, got_grad, graphs, loss_compiles, outputs, _ = _families(tmp_path, True, edits, 14)
    steps = sorted({step for _, step, _ in want_actv})
    assert steps and set(range(4)) <= set(steps) and not set(range(5, 7)) & set(steps), steps
    assert max(steps) >= 12
    _same_rows(got_actv, want_actv)
    _same_rows(got_grad, compiled_grads(want_grad))
    # independent reference: the last Linear's output is the model's output
    for step in steps:
        assert float(got_actv[("2.output", step, 0)]["norm"]) == pytest.approx(
            float(outputs[step].double().norm()), rel=1e-5
        )
        assert torch.allclose(outputs[step], eager_out[step], rtol=1e-5, atol=1e-6)
    # the loss function compiled twice (static, then dynamic sizes) in the first steps, never after
    assert loss_compiles == 2, loss_compiles
    # off: the model's graph without the hooks' taps, compiled once; every switch after it: cached
    assert graphs[-1] - graphs[3] <= 1, graphs
    assert not [r for r in caplog.records if "caches were reset" in r.getMessage()]


def test_evaluation_pass_compiles_once_across_family_switches(tmp_path, out_dir, dynamic_mode):
    """An eval()+no_grad pass after each step while forward_only and backward_only switch: its graph
    does not depend on the monitor's flags, one graph for every switch (dynamo's recompile_limit is 8 per
    function: one more eval graph per flag combination used it up)."""
    edits = {
        2: {"forward_only": True},
        4: {"forward_only": False, "backward_only": True},
        6: {"backward_only": False},
        8: {"dynamic_on": False},
        10: {"dynamic_on": True, "forward_only": True},
    }
    want_actv, want_grad, _, _, _, _ = _families(tmp_path, False, edits, 12, eval_pass=True)
    got_actv, got_grad, graphs, _, _, eval_graphs = _families(tmp_path, True, edits, 12, eval_pass=True)
    _same_rows(got_actv, want_actv)
    _same_rows(got_grad, compiled_grads(want_grad))
    actv_steps, grad_steps = {s for _, s, _ in want_actv}, {s for _, s, _ in want_grad}
    assert 3 in actv_steps - grad_steps and 5 in grad_steps - actv_steps, (actv_steps, grad_steps)
    # the eval graph: static, then dynamic batch size; not one more per flag combination
    assert eval_graphs <= 2, (eval_graphs, graphs)


def test_targets_edit_selecting_new_modules_says_the_reset(tmp_path, out_dir, dynamic_mode, caplog):
    """A targets edit that selects a module never hooked while compiled graphs exist still resets dynamo's
    caches (its hooks are not in those graphs): said at WARNING, with that reason; its rows then follow."""
    path = tmp_path / "cfg.json"
    path.write_text('{"xy_distribution": true, "ops": ["norm"], "dynamic_on": true, "targets": {"0": {}}}')
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(str(path))
    monitor.set_monitor(model, optimizer=opt)
    run = torch.compile(model, backend="aot_eager")
    outputs = []
    for i in range(5):
        if i == 2:
            update_config_file(str(path), targets={"0": {}, "2": {}})
            _wait_dirty(monitor)
        out = run(torch.randn(3, 4))
        outputs.append(out.detach().clone())
        out.square().sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    said = [r for r in caplog.records if "modules not hooked were selected (2)" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", [r.getMessage() for r in caplog.records]
    assert "every compiled function in the process" in said[0].getMessage()
    actv = keyed(read_family(monitor.run_dir, "actv"))
    later = sorted(s for name, s, _ in actv if name == "2.output")
    assert later and min(later) >= 2 and later[-1] == 4, later
    for step in later:  # independent reference: the last Linear's output is the model's output
        assert float(actv[("2.output", step, 0)]["norm"]) == pytest.approx(
            float(outputs[step].norm()), rel=1e-5
        )


@pytest.mark.parametrize("none_here", [{"module_ranks": [1]}, {"targets": {"nomatch": {}}}])
def test_families_on_again_selecting_nothing_here_writes_nothing(tmp_path, out_dir, dynamic_mode, none_here):
    """Families off (hooks kept, pinned), then on again with no module selected on this rank (another
    rank's `module_ranks`, or targets matching nothing): the kept hooks go, as in an eager run; they wrote
    rows on every step after (rank-excluded rows, equal to the model's output)."""
    edits = {4: {"xy_distribution": False}, 7: {"xy_distribution": True, **none_here}}
    want_actv, _, _, _, _, _ = _families(tmp_path, False, edits, 10)
    got_actv, got_grad, _, _, _, _ = _families(tmp_path, True, edits, 10)
    want = sorted({step for _, step, _ in want_actv})
    assert want and max(want) < 7, want  # eager: nothing once the families are on again here
    assert sorted({step for _, step, _ in got_actv}) == want
    assert sorted({step for _, step, _ in got_grad}) == want


def test_a_copy_of_the_model_compiled_fullgraph_for_evaluation_runs(tmp_path, out_dir, static_mode):
    """A deepcopy of the monitored model (an EMA or reference model: not monitored) compiled with
    fullgraph=True and run in eval mode without grad: its copied hooks trace to nothing (the copy's
    probe has no hooks to pin: dynamo raised Unsupported)."""
    import copy

    path = tmp_path / "cfg.json"
    path.write_text('{"xy_distribution": true, "ops": ["norm"]}')
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(str(path))
    monitor.set_monitor(model, optimizer=opt)
    torch.compile(model, backend="aot_eager")(torch.randn(3, 4)).sum().backward()  # pins the hooks
    opt.step()
    opt.zero_grad()
    ema = copy.deepcopy(model).eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        got = torch.compile(ema, backend="aot_eager", fullgraph=True)(x)
        want = ema(x)
    monitor.close()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    rows = keyed(read_family(monitor.run_dir, "actv"))  # the monitored model's step only, not the copy's
    assert ("2.output", 0, 0) in rows and {(step, micro) for _, step, micro in rows} == {(0, 0)}
