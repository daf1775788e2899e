"""Gradients are read before the user's gradient clipping scales them (`runtime/clip_watch.py`): the
grad_reduced rows and the global grad norm are the pre-clip values, whichever way the loop clips, and the
global grad norm equals what `clip_grad_norm_` returns. References: the gradients cloned in the test just
before the clipping call, in float64."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_  # imported by name before any monitor exists

import trainermon.runtime.clip_watch as clip_watch
from trainermon import TrainerMon

MAX_NORM = 1e-3  # far below the gradients' norm (~1): every step is clipped


def _total_then_scale(params) -> torch.Tensor:
    """torchtitan's way: the norm first, then the public in-place scaling."""
    params = list(params)
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
    return total


CLIPS = {
    "clip_grad_norm_": lambda params: torch.nn.utils.clip_grad_norm_(list(params), MAX_NORM),
    "imported-by-name": lambda params: clip_grad_norm_(list(params), MAX_NORM),
    "generator": lambda params: torch.nn.utils.clip_grad_norm_((p for p in params), MAX_NORM),
    "keyword": lambda params: torch.nn.utils.clip_grad_norm_(parameters=list(params), max_norm=MAX_NORM),
    "total-then-scale": _total_then_scale,
    "by-value": lambda params: torch.nn.utils.clip_grad_value_(list(params), MAX_NORM),
}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _monitor(tmp_path, monkeypatch, model, optimizer, name: str = "config.json", **extra) -> TrainerMon:
    path = tmp_path / name
    config = {"targets": {}, "wg_distribution": True, "ops": ["norm", "min", "max"], "format": "csv"}
    path.write_text(json.dumps({**config, **extra}))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monitor = TrainerMon(str(path))
    monitor.set_monitor(model, optimizer=optimizer)
    return monitor


def _norms(monitor: TrainerMon, family: str) -> dict[str, float]:
    batch = monitor.last_batch
    norms = batch.values["norm"]
    return {r.name: float(norms[i]) for i, r in enumerate(batch.rows) if r.family == family}


def _backward(model: nn.Module, seed: int) -> None:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).device)
    (model(x).square().mean() * 100).backward()


def _before_clip(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().to(torch.float64).clone() for n, p in model.named_parameters()}


CASES = [("cpu", how) for how in sorted(CLIPS)] + [
    pytest.param(
        "cuda", how, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: none here")
    )
    for how in ("clip_grad_norm_", "total-then-scale")
]


@pytest.mark.parametrize("device,how", CASES)
def test_rows_and_global_norm_are_read_before_clipping(tmp_path, monkeypatch, device, how):
    """On CUDA the read is kernels queued on the stream ahead of the clipping's in-place scaling."""
    torch.manual_seed(0)
    model = _net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor(tmp_path, monkeypatch, model, optimizer)
    try:
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            _backward(model, step)
            ref = _before_clip(model)
            returned = CLIPS[how](model.parameters())
            clipped = {n: float(p.grad.double().norm()) for n, p in model.named_parameters()}
            optimizer.step()
            monitor.flush()
            want = {n: float(g.norm()) for n, g in ref.items()}
            want_total = math.sqrt(sum(v * v for v in want.values()))
            assert want_total > 100 * MAX_NORM  # the clipping did scale the gradients
            assert max(clipped.values()) < 0.1 * max(want.values())
            for family in ("grad_reduced", "grad_unreduced"):
                got = _norms(monitor, family)
                assert got.keys() == want.keys(), (family, got.keys())
                for name, value in got.items():
                    assert value == pytest.approx(want[name], rel=1e-5), (how, step, family, name)
            global_norm = monitor.last_batch.derived.global_grad_norm
            assert global_norm == pytest.approx(want_total, rel=1e-5)
            if returned is not None:  # clip_grad_norm_ returns the norm it clipped by: the same
                assert global_norm == pytest.approx(float(returned), rel=1e-5)
        assert monitor.faults.total == 0
    finally:
        monitor.close()


def _originals() -> dict[str, object]:
    return {f"{e.owner.__name__}.{e.name}": e.owner.__dict__[e.name] for e in clip_watch.torch_clip_entries()}


def test_torch_functions_are_wrapped_on_collected_steps_only(tmp_path, monkeypatch):
    """step_interval 2: the wrappers exist while a step that collects gradients runs, not on the steps
    between, and not after close."""
    originals = _originals()
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor(tmp_path, monkeypatch, model, optimizer, step_interval=2)
    wrapped_at: list[bool] = []
    try:
        for step in range(4):
            optimizer.zero_grad(set_to_none=True)
            _backward(model, step)
            wrapped_at.append(_originals() != originals)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
    finally:
        monitor.close()
    assert wrapped_at == [True, False, True, False]
    assert _originals() == originals
    assert clip_grad_norm_ is torch.nn.utils.clip_grad_norm_  # the public function itself is never replaced


def test_clipping_another_model_reads_nothing(tmp_path, monkeypatch):
    """Two models, two monitors, one loop (a GAN): the first model's clipping comes before the second
    model's backward; the second monitor reads its gradients at its own clipping, not at the first's."""
    torch.manual_seed(0)
    first, second = _net(), _net()
    opt_first = torch.optim.SGD(first.parameters(), lr=0.01)
    opt_second = torch.optim.SGD(second.parameters(), lr=0.01)
    mon_first = _monitor(tmp_path, monkeypatch, first, opt_first, "first.json")
    mon_second = _monitor(tmp_path, monkeypatch, second, opt_second, "second.json")
    try:
        for step in range(2):
            opt_first.zero_grad(set_to_none=True)
            opt_second.zero_grad(set_to_none=True)
            _backward(first, step)
            ref_first = _before_clip(first)
            torch.nn.utils.clip_grad_norm_(first.parameters(), MAX_NORM)
            opt_first.step()
            _backward(second, 10 + step)
            ref_second = _before_clip(second)
            torch.nn.utils.clip_grad_norm_(second.parameters(), MAX_NORM)
            opt_second.step()
            for monitor, ref in ((mon_first, ref_first), (mon_second, ref_second)):
                monitor.flush()
                got = _norms(monitor, "grad_reduced")
                assert got == pytest.approx({n: float(g.norm()) for n, g in ref.items()}, rel=1e-5)
        assert mon_first.faults.total == 0 and mon_second.faults.total == 0
    finally:
        mon_first.close()
        mon_second.close()


def test_a_failure_in_the_clipping_watch_never_reaches_the_loop(tmp_path, monkeypatch):
    """The read at clipping raises: counted once, the user's clipping runs and returns its norm, and the
    step's rows are read at the pre-step (then post-clip: the only gradients left)."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor(tmp_path, monkeypatch, model, optimizer)

    def broken() -> None:
        raise RuntimeError("boom")

    try:
        monkeypatch.setattr(monitor.loop, "on_grads_final", broken)
        optimizer.zero_grad(set_to_none=True)
        _backward(model, 0)
        ref_total = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        returned = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert float(returned) == pytest.approx(ref_total, rel=1e-6)
        monkeypatch.undo()
        optimizer.step()
        monitor.flush()
        assert monitor.faults.total == 1
        assert monitor.last_batch.derived.global_grad_norm == pytest.approx(MAX_NORM, rel=1e-3)
    finally:
        monitor.close()


@pytest.fixture
def fresh_dynamo():
    """Compiled code and dynamo's counters must not reach later tests (they pin module hooks)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def test_a_compiled_clipping_runs_compiled_and_is_read_at_the_pre_step(tmp_path, monkeypatch, fresh_dynamo):
    """`clip_grad_norm_` inside `torch.compile(fullgraph=True)`, every other step collected: the wrapper
    is traced through to torch's function (a graph break would fail fullgraph), the clipping runs as a
    compiled graph on every step, and the rows, read at the pre-step, are post-clip (as documented)."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor(tmp_path, monkeypatch, model, optimizer, step_interval=2)
    counter = CompileCounter()
    clip = torch.compile(
        lambda params: torch.nn.utils.clip_grad_norm_(params, MAX_NORM), backend=counter, fullgraph=True
    )
    try:
        for step in range(4):
            optimizer.zero_grad(set_to_none=True)
            _backward(model, step)
            want = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
            returned = float(clip(list(model.parameters())))
            optimizer.step()
            monitor.flush()
            assert returned == pytest.approx(want, rel=1e-6) and want > 100 * MAX_NORM
            if step % 2 == 0:
                assert monitor.last_batch.step == step
                assert monitor.last_batch.derived.global_grad_norm == pytest.approx(MAX_NORM, rel=1e-3)
        assert monitor.faults.total == 0
    finally:
        monitor.close()
    # one graph per variant of the clipping's globals (wrapped, original); every call ran a graph
    assert 1 <= counter.frame_count <= 2, counter.frame_count


def _clear(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def test_an_iteration_dropped_without_zero_grad_is_read_again(tmp_path, monkeypatch):
    """A loop that drops an iteration whose clipped norm is not finite (`continue`, gradients cleared by
    `p.grad = None`, no zero_grad() and no optimizer step): the next iteration's clipping reads its own
    gradients and the first read's rows are taken out; the step's rows are the applied iteration's."""
    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor(tmp_path, monkeypatch, model, optimizer)
    applied: list[dict[str, torch.Tensor]] = []
    try:
        for iteration in range(3):
            _clear(model)
            _backward(model, iteration)
            if iteration == 1:
                next(model.parameters()).grad[0, 0] = float("nan")  # this iteration is dropped
            ref = _before_clip(model)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if not torch.isfinite(norm):
                continue
            applied.append(ref)
            optimizer.step()
            monitor.flush()
            got = _norms(monitor, "grad_reduced")
            assert got == pytest.approx({n: float(g.norm()) for n, g in ref.items()}, rel=1e-5), iteration
            assert len(monitor.last_batch.rows) == len(ref) * 2  # grad_reduced and grad_unreduced, once
            total = math.sqrt(sum(float(g.norm()) ** 2 for g in ref.values()))
            assert monitor.last_batch.derived.global_grad_norm == pytest.approx(total, rel=1e-5)
        assert len(applied) == 2 and monitor.faults.total == 0
    finally:
        monitor.close()


def test_clipping_each_micro_batch_reads_before_the_last_clipping(tmp_path, monkeypatch):
    """Clipping after every micro-batch's backward (an accumulation loop that clips too often): the
    step's rows are the gradients just before its last clipping, the ones the optimizer's input is made
    from, not the first micro-batch's alone."""
    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor(tmp_path, monkeypatch, model, optimizer)
    try:
        for step in range(2):
            optimizer.zero_grad(set_to_none=True)
            for micro in range(3):
                _backward(model, 10 * step + micro)
                ref = _before_clip(model)
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            monitor.flush()
            got = _norms(monitor, "grad_reduced")
            assert got == pytest.approx({n: float(g.norm()) for n, g in ref.items()}, rel=1e-5), step
            assert len(monitor.last_batch.rows) == len(ref) * 2
        assert monitor.faults.total == 0
    finally:
        monitor.close()


def test_a_clipping_before_any_gradient_exists_reads_again_at_the_next(tmp_path, monkeypatch):
    """FSDP2 under `set_requires_gradient_sync(False)` has no `.grad` until its reducing micro-batch, so a
    loop clipping every micro-batch first clips nothing: the next clipping reads the gradients (found
    with FSDP2 on 2 ranks, where the global norm was 0)."""
    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _monitor(tmp_path, monkeypatch, model, optimizer)
    try:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # no gradient yet
        _backward(model, 0)
        ref = _before_clip(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        monitor.flush()
        assert _norms(monitor, "grad_reduced") == pytest.approx({n: float(g.norm()) for n, g in ref.items()})
        total = math.sqrt(sum(float(g.norm()) ** 2 for g in ref.values()))
        assert monitor.last_batch.derived.global_grad_norm == pytest.approx(total, rel=1e-5)
    finally:
        monitor.close()


@pytest.mark.parametrize("ops", [["norm"], ["norm", "nans", "infs"], ["norm", "nans"]])
@pytest.mark.parametrize("bad", [math.nan, math.inf, "both"])
@pytest.mark.parametrize("split", [False, True], ids=["rows", "job-sum"])
def test_a_nonfinite_gradient_makes_the_global_norm_what_clipping_returns(
    tmp_path, monkeypatch, ops, bad, split
):
    """With `nans`/`infs` counted, each row's norm covers its finite elements (README), but the global
    norm is the one `clip_grad_norm_` uses: NaN if any element is NaN, else inf if any is inf.
    `job-sum`: the path of a model split over ranks (the job's sum of squares, formed on the device)."""
    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = _monitor(tmp_path, monkeypatch, model, optimizer, ops=ops)
    if split:
        monkeypatch.setattr(type(monitor.loop.adapter), "splits_model", property(lambda self: True))
    try:
        for step in range(2):
            optimizer.zero_grad(set_to_none=True)
            _backward(model, step)
            if step == 1:
                model[0].weight.grad[0, 0] = math.nan if bad == "both" else bad
                if bad == "both":
                    model[2].bias.grad[1] = math.inf
            returned = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
            optimizer.step()
            monitor.flush()
            got = monitor.last_batch.derived.global_grad_norm
            if step == 0:
                assert math.isfinite(got) and got == pytest.approx(returned, rel=1e-5)
            else:  # nan, or inf (same sign): what clip_grad_norm_ returned
                assert math.isnan(returned) == math.isnan(got) and (math.isnan(got) or got == returned), (
                    got,
                    returned,
                )
                assert not math.isfinite(got)
        assert monitor.faults.total == 0
    finally:
        monitor.close()
