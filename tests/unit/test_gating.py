"""Which steps are collected, and proof that the others compute nothing."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

import trainermon.runtime.probes.grad_rows as grad_rows
from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.runtime.probes.graph_taps import HOOKS_IN_GRAPH


def _train(tmp_path, monkeypatch, steps: int, grad_acc: int = 1, start_iteration: int = 0, **cfg):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg.setdefault("wg_distribution", True)
    path = write_config(tmp_path / "cfg.json", **cfg)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, grad_acc_steps=grad_acc, optimizer=opt, start_iteration=start_iteration)
    calls_per_step = []
    for _ in range(steps):
        before = monitor.loop.engine.calls
        for _ in range(grad_acc):
            model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        calls_per_step.append(monitor.loop.engine.calls - before)
    monitor.close()
    return monitor, calls_per_step


def _steps(rows) -> list[int]:
    return sorted({int(r["step"]) for r in rows})


def test_start_step_interval_collect_times(tmp_path, monkeypatch):
    monitor, calls = _train(tmp_path, monkeypatch, 12, start_step=2, step_interval=3, collect_times=3)
    assert _steps(read_family(monitor.run_dir, "grad_reduced")) == [2, 5, 8]
    # Engine calls happen on collected steps only; every other step computes nothing at all.
    assert [i for i, c in enumerate(calls) if c] == [2, 5, 8]
    assert monitor.loop.transfers.count == 3


def test_start_iteration_offsets_the_step_counter(tmp_path, monkeypatch):
    monitor, _ = _train(tmp_path, monkeypatch, 3, start_iteration=100, start_step=101)
    assert _steps(read_family(monitor.run_dir, "grad_reduced")) == [101, 102]


def test_collect_times_zero_collects_nothing(tmp_path, monkeypatch):
    monitor, calls = _train(tmp_path, monkeypatch, 4, collect_times=0, xy_distribution=True)
    assert sum(calls) == 0 and monitor.loop.transfers.count == 0
    assert (
        not [f for f in os.listdir(monitor.run_dir) if f.endswith(".csv")]
        if os.path.isdir(monitor.run_dir)
        else True
    )


def test_step_count_per_record_buckets_files(tmp_path, monkeypatch):
    monitor, _ = _train(tmp_path, monkeypatch, 7, step_count_per_record=3)
    files = sorted(f for f in os.listdir(monitor.run_dir) if f.startswith("grad_reduced"))
    assert files == ["grad_reduced_0-2.csv", "grad_reduced_3-5.csv", "grad_reduced_6-8.csv"]
    with open(os.path.join(monitor.run_dir, "grad_reduced_3-5.csv")) as fh:
        lines = fh.read().splitlines()
    assert lines[0].startswith("vpp_stage,name,step")  # one header per file
    assert {line.split(",")[2] for line in lines[1:]} == {"3", "4", "5"}


def test_micro_step_numbering(tmp_path, monkeypatch):
    monitor, _ = _train(tmp_path, monkeypatch, 2, grad_acc=3, xy_distribution=True, forward_only=True)
    rows = [r for r in read_family(monitor.run_dir, "actv") if r["name"] == "0.output"]
    assert [(int(r["step"]), int(r["micro_step"])) for r in rows] == [
        (s, m) for s in (0, 1) for m in (0, 1, 2)
    ]
    assert read_family(monitor.run_dir, "actv_grad") == []  # forward_only


@pytest.fixture
def fresh_dynamo():
    """No compiled graphs nor dynamo counters left to later tests, pass or fail: a monitor attached after
    graphs were compiled pins its hooks at once (see test_compile.py)."""
    yield
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_evaluation_pass_between_steps_is_no_micro_batch(
    tmp_path, out_dir, caplog, fresh_dynamo, compiled
):
    """model.eval() + no_grad forwards between optimizer steps (an HF Trainer or Lightning evaluation)
    were actv rows numbered as the next step's first micro-batches, shifting the real ones (actv_grad
    too). They get no rows now, and one INFO line says so; a training forward in eval mode (with grad)
    still counts."""
    import logging

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", xy_distribution=True, ops=["norm"]))
    monitor.set_monitor(model, grad_acc_steps=2, optimizer=opt)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    x = {s: [torch.randn(3, 4) for _ in range(2)] for s in range(3)}
    with caplog.at_level(logging.INFO, logger="trainermon"):
        for step in range(3):
            if step == 1:
                run.eval()
                with torch.no_grad():
                    for _ in range(3):
                        run(torch.randn(5, 4))
                run.train()
            if step == 2:
                run.eval()  # dropout off, still training: counted
            for micro in range(2):
                run(x[step][micro]).sum().backward()
            run.train()
            opt.step()
            opt.zero_grad()
    monitor.close()
    for family in ("actv", "actv_grad"):
        rows = [r for r in read_family(monitor.run_dir, family) if r["name"] == "0.output"]
        # no actv_grad rows from compiled graphs on a torch older than 2.12 (test_graph_taps.py)
        want = (
            []
            if compiled and family == "actv_grad" and not HOOKS_IN_GRAPH
            else [(s, m) for s in range(3) for m in range(2)]
        )
        assert sorted((int(r["step"]), int(r["micro_step"])) for r in rows) == want, family
    said = [r.getMessage() for r in caplog.records if "evaluation pass" in r.getMessage()]
    assert len(said) == 1, said


def test_gradient_hooks_are_kept_across_steps(tmp_path, monkeypatch):
    """One gradient hook per hooked slot and micro-step, made on the first collected step and reused after
    (no new hook objects per step for the garbage collector), with each step's rows still its own: the
    norm of 2.output's gradient, d(sum)/d(out) = ones(3, 2) per micro-batch, sqrt(6) at every micro_step."""
    made = []
    real_init = grad_rows.GradRows.__init__

    def counting(hook, *args):
        made.append(args)
        real_init(hook, *args)

    monkeypatch.setattr(grad_rows.GradRows, "__init__", counting)
    monitor, _ = _train(tmp_path, monkeypatch, 3, grad_acc=2, xy_distribution=True, backward_only=True)
    # per micro-step: 0.input (x needs no grad: none), 0.output, 1.input, 1.output, 2.input, 2.output
    assert len(made) == 2 * 5
    rows = [r for r in read_family(monitor.run_dir, "actv_grad") if r["name"] == "2.output"]
    expected = [(s, m) for s in range(3) for m in (0, 1)]
    assert [(int(r["step"]), int(r["micro_step"])) for r in rows] == expected
    assert all(float(r["norm"]) == pytest.approx(6**0.5, rel=1e-6) for r in rows)


def test_backward_only_and_targets(tmp_path, monkeypatch):
    monitor, _ = _train(
        tmp_path,
        monkeypatch,
        1,
        xy_distribution=True,
        backward_only=True,
        targets={"2": {}},
        wg_distribution=True,
    )
    assert read_family(monitor.run_dir, "actv") == []
    assert {r["name"] for r in read_family(monitor.run_dir, "actv_grad")} == {"2.input", "2.output"}
    # targets are parameter-name prefixes for the weight families
    assert {r["name"] for r in read_family(monitor.run_dir, "grad_reduced")} == {"2.weight", "2.bias"}


@pytest.mark.parametrize("ranks,hooked", [([1, 2], False), ([0], True)])
def test_module_ranks(tmp_path, monkeypatch, ranks, hooked):
    monitor, _ = _train(tmp_path, monkeypatch, 1, xy_distribution=True, module_ranks=ranks)
    assert bool(read_family(monitor.run_dir, "actv")) is hooked
    assert read_family(monitor.run_dir, "grad_reduced")  # module_ranks limits module hooks only


def test_module_hooks_exist_on_collected_steps_only(tmp_path, out_dir, monkeypatch):
    """Eager: a module hook, even one that returns at once, sends every call of its module down PyTorch's
    slow path, so the activation hooks are added when a collected step begins and removed when a step
    that collects nothing begins: no hook, no record, no gradient hook on any tensor on other steps. The
    root keeps one forward pre-hook, which watches for a torch.compile trace (see test_compile.py) and
    notes the grad mode its forward began with, and one forward hook that ends that note (see
    test_checkpointing.py): two calls per forward of the model, none per module."""
    path = write_config(tmp_path / "cfg.json", xy_distribution=True, start_step=1, collect_times=1)
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, optimizer=opt)
    inner = model[0]
    counts, records, grad_hooked = [], [], []
    original = monitor.loop.record_local
    monitor.loop.record_local = lambda family, *a, **k: records.append(family) or original(family, *a, **k)
    grad_hooks = []  # the gradient hooks registered (one per hooked tensor, on the node that makes it)
    get_hook = grad_rows.GradRowsCache.get

    def counted(cache, *args):
        grad_hooks.append(args)
        return get_hook(cache, *args)

    monkeypatch.setattr(grad_rows.GradRowsCache, "get", counted)
    for _ in range(3):
        counts.append(len(inner._forward_hooks) + len(inner._forward_pre_hooks))
        records.clear()
        grad_hooks.clear()
        model(torch.randn(2, 4)).sum().backward()
        grad_hooked.append(len(grad_hooks))
        counts.append(bool(records))
        opt.step()
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1  # the root's watchers
    monitor.close()
    assert counts == [0, False, 2, True, 0, False]  # the monitor's two hooks, on step 1 only
    assert grad_hooked == [0, 1, 0]  # Linear's output (its input needs no gradient), on step 1 only
    assert not inner._forward_hooks and not inner._forward_pre_hooks  # close removes them
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_second_optimizer_does_not_advance_the_step(tmp_path, out_dir):
    path = write_config(tmp_path / "cfg.json", wg_distribution=True)
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    opt, other_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, optimizer=opt)
    for _ in range(2):
        (model(torch.ones(1, 2)).sum() + other(torch.ones(1, 2)).sum()).backward()
        other_opt.step()
        other_opt.step()
        opt.step()
    monitor.close()
    assert monitor.current_step == 2
    assert _steps(read_family(monitor.run_dir, "grad_reduced")) == [0, 1]


def test_manual_step_without_optimizer(tmp_path, out_dir):
    path = write_config(tmp_path / "cfg.json", wg_distribution=True, param_distribution=True)
    model = nn.Linear(3, 1)
    monitor = TrainerMon(path)
    monitor.set_monitor(model)
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        monitor.step()
        model.zero_grad()
    monitor.close()
    assert _steps(read_family(monitor.run_dir, "grad_reduced")) == [0, 1]
    norms = {r["name"]: float(r["norm"]) for r in read_family(monitor.run_dir, "grad_reduced")}
    assert norms == pytest.approx({"weight": 3**0.5, "bias": 1.0})  # input ones(3): dW = ones(1, 3), db = 1


def test_manual_step_says_what_it_cannot_see(tmp_path, out_dir, caplog):
    """step() runs after the update (param_origin is the updated parameters) and, called after
    zero_grad(), finds no gradients: each said once, not a silent empty or wrong family."""
    path = write_config(tmp_path / "cfg.json", wg_distribution=True, param_distribution=True)
    model = nn.Linear(3, 1)
    monitor = TrainerMon(path)
    monitor.set_monitor(model)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        for _ in range(3):
            model(torch.ones(1, 3)).sum().backward()
            model.zero_grad()  # too early: the gradients are gone before step()
            monitor.step()
    monitor.close()
    said = [r.getMessage() for r in caplog.records]
    assert sum("found no gradients" in m for m in said) == 1, said
    assert sum("param_origin holds the updated parameters" in m for m in said) == 1, said
    assert read_family(monitor.run_dir, "grad_reduced") == []


def test_vpp_chunks_get_their_stage(tmp_path, out_dir):
    path = write_config(tmp_path / "cfg.json", wg_distribution=True, xy_distribution=True, forward_only=True)
    chunks = [nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))]
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.1)
    monitor = TrainerMon(path)
    monitor.set_monitor(chunks, optimizer=opt)
    chunks[1](chunks[0](torch.ones(1, 2))).sum().backward()
    opt.step()
    monitor.close()
    grads = read_family(monitor.run_dir, "grad_reduced")
    assert sorted((r["vpp_stage"], r["name"]) for r in grads) == [
        ("0", "0.bias"),
        ("0", "0.weight"),
        ("1", "0.bias"),
        ("1", "0.weight"),
    ]
    assert {(r["vpp_stage"], r["name"]) for r in read_family(monitor.run_dir, "actv")} == {
        ("0", "0.input"),
        ("0", "0.output"),
        ("1", "0.input"),
        ("1", "0.output"),
    }


def test_gradients_are_computed_once_when_nothing_reduces_them(tmp_path, monkeypatch):
    """Plain PyTorch: grad_unreduced and grad_reduced are the same tensors; one engine pass gives both."""
    monitor, calls = _train(tmp_path, monkeypatch, 2)
    assert calls == [1, 1]
    unreduced = {r["name"]: r["norm"] for r in read_family(monitor.run_dir, "grad_unreduced")}
    reduced = {r["name"]: r["norm"] for r in read_family(monitor.run_dir, "grad_reduced")}
    assert unreduced == reduced and len(reduced) == 4
