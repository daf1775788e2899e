"""One tensor seen by several hooks in a step is reduced once, and never reused after it changed.

An activation is usually a module's output and the next module's input, and a container's output is its
last child's output; the collector reduces such a tensor once (keyed by its memory, layout and version
counter). These tests check that the shortcut is exact: an in-place change between two hooks (ReLU with
inplace=True) gives a fresh row, and a run with the shortcut switched off gives identical rows.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import trainermon.collect.hook_rows as hook_rows_module
from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon
from trainermon.collect.records import StepScalars


class ResidualNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)  # rewrites a's output in place
        self.b = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())  # container output = child output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.a(x))
        y = self.b(h) + h  # residual: gradients of h accumulate from two consumers
        y = self.block(y)
        return self.block(y)  # the same module twice: micro_step 0 and 1


def _run(tmp_path, monkeypatch, name: str, dedup: bool):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / name))
    if not dedup:
        monkeypatch.setattr(hook_rows_module, "_value_key", lambda t: None)
    cfg = write_config(
        tmp_path / f"{name}.json", xy_distribution=True, all_xy=True, ops=["norm", "min", "max", "mean"]
    )
    torch.manual_seed(0)
    model = ResidualNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    computed = []
    original = monitor.loop.engine.compute_rows

    def counting(tensors):
        computed.append(len(tensors))
        return original(tensors)

    monitor.loop.engine.compute_rows = counting
    one_row = monitor.loop.engine.kernel_row

    def counting_one(t, table, row):  # the native kernel's rows written at the hook
        written = one_row(t, table, row)
        computed.append(int(written))
        return written

    monitor.loop.engine.kernel_row = counting_one
    # Reference: our own hooks registered before the monitor's step hooks, cloning at hook time.
    reference: dict[str, torch.Tensor] = {}

    def keep(label):
        def hook(module, args, output):
            reference.setdefault(f"{label}.output", output.detach().clone())

        return hook

    for label in ("a", "relu", "block", "block.1"):
        model.get_submodule(label).register_forward_hook(keep(label))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    monitor.close()
    monkeypatch.undo()
    return _rows(monitor.run_dir, "actv"), _rows(monitor.run_dir, "actv_grad"), sum(computed), reference


def _rows(run_dir: str, family: str) -> dict[tuple, dict[str, float]]:
    return {
        key: {op: float(row[op]) for op in ("norm", "min", "max", "mean")}
        for key, row in keyed(read_family(run_dir, family)).items()
    }


def test_shared_tensors_are_reduced_once_and_exactly(tmp_path, monkeypatch):
    actv, actv_grad, computed, reference = _run(tmp_path, monkeypatch, "dedup", dedup=True)
    actv_off, actv_grad_off, computed_off, _ = _run(tmp_path, monkeypatch, "plain", dedup=False)

    # The shortcut changes nothing in the output, row for row ...
    assert len(actv) == len(actv_off) and len(actv_grad) == len(actv_grad_off)
    for ours, plain in ((actv, actv_off), (actv_grad, actv_grad_off)):
        for key, row in ours.items():
            for op in ("norm", "min", "max", "mean"):
                assert row[op] == plain[key][op], (key, op)
    # ... and saves work: fewer tensors reduced than rows written
    assert computed < computed_off

    def stats(step, name, micro=0):
        return actv[(name, step, micro)]

    # a's output was reduced before ReLU rewrote it: it still has the negative values
    pre_relu = reference["a.output"]
    assert stats(0, "a.output")["min"] == pytest.approx(float(pre_relu.min()), rel=1e-5)
    assert stats(0, "a.output")["min"] < 0
    # ReLU's input and output are the rewritten tensor
    assert stats(0, "relu.input")["min"] >= 0 and stats(0, "relu.output")["min"] >= 0
    assert stats(0, "relu.input")["norm"] == pytest.approx(float(reference["relu.output"].norm()), rel=1e-5)
    # container and its last child: one tensor, identical rows
    for op in ("norm", "min", "max", "mean"):
        assert stats(0, "block.output")[op] == stats(0, "block.1.output")[op]
    assert stats(0, "block.output")["norm"] == pytest.approx(
        float(reference["block.output"].norm()), rel=1e-5
    )
    # reused module: two micro steps with different values
    assert stats(0, "block.output", 1)["norm"] != stats(0, "block.output", 0)["norm"]
    assert all(math.isfinite(r["norm"]) for r in actv_grad.values())


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return self.attn(h, h, h, need_weights=False)[0]


def test_one_tensor_passed_as_several_inputs_stays_one_object(tmp_path, out_dir):
    """attn(h, h, h) must still receive one object: nn.MultiheadAttention takes its packed self-attention
    path only when query is key is value, and the input-gradient taps must not change the model's code
    path. Each of the three input labels reports the gradient that flows into the module through h."""
    cfg = write_config(tmp_path / "c.json", xy_distribution=True, all_xy=True, ops=["norm", "min", "max"])
    torch.manual_seed(0)
    model = SelfAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    same_object = []
    model.attn.register_forward_pre_hook(  # registered after the monitor's: sees the arguments it passes
        lambda module, args, kwargs: same_object.append(args[0] is args[1] is args[2]), with_kwargs=True
    )
    x = torch.randn(4, 6, 16)
    h_grads = []
    model.ln.register_forward_hook(lambda m, a, out: out.register_hook(h_grads.append) and None)
    computed = []
    original = monitor.loop.engine.compute_rows
    monitor.loop.engine.compute_rows = lambda tensors: computed.append(len(tensors)) or original(tensors)
    out = model(x)
    computed.clear()  # count the backward's reductions only
    out.square().sum().backward()
    opt.step()
    monitor.close()

    assert same_object == [True]
    rows = {r["name"]: r for r in read_family(monitor.run_dir, "actv_grad")}
    want = h_grads[0].double()  # h has one consumer (attn), so its gradient is attn's input gradient
    for i in range(3):
        row = rows[f"attn.input_{i}"]
        assert float(row["norm"]) == pytest.approx(float(want.norm()), rel=1e-5)
        assert float(row["min"]) == pytest.approx(float(want.min()), rel=1e-5)
        assert float(row["max"]) == pytest.approx(float(want.max()), rel=1e-5)
    # five rows (attn output, its three inputs, ln output); the three input rows came from one reduction
    assert len(rows) == 5 and sum(computed) <= 3


# ==== the reuse cache never hands one tensor's row to another ==========================================
def _collector():
    from trainermon.collect.collector import StepCollector, TransferCounter
    from trainermon.stats import EngineOptions, StatsEngine

    return StepCollector(StatsEngine(EngineOptions(nonfinite=False)), TransferCounter())


def _norms(collector) -> list[float]:
    payload = collector.finish(0, StepScalars())
    return payload.partials[:, 0].sqrt().tolist()


@pytest.fixture
def addresses_collide(monkeypatch):
    """The worst case of memory reuse, made deterministic: the cache key loses the storage object's and
    the data's addresses, so any later tensor of the same size, shape, layout and version looks like the
    one computed before (what the allocator does when it hands freed memory and a freed storage object
    back at the same addresses; waiting for it to happen made these tests skip in half the runs)."""
    real = hook_rows_module._value_key

    def without_addresses(t):  # the two addresses zeroed, every other field where the collector reads it
        key = real(t)
        return None if key is None else (0, key[1], 0, *key[3:])

    monkeypatch.setattr(hook_rows_module, "_value_key", without_addresses)


def test_memory_replaced_through_data_is_not_reused():
    """Megatron's deallocate_output_tensor: `out.data = torch.empty(1)` frees out's memory while `out`
    lives on; the next tensor of that shape at that address, same version, must be computed afresh."""
    buf = bytearray(4 * 32)
    first = torch.frombuffer(buf, dtype=torch.float32).view(4, 8)  # version 0, at buf's address
    buf[:] = torch.full((32,), 1.0).numpy().tobytes()  # writes no version counter
    collector = _collector()
    collector.add_local("actv", 0, ["a.output"], 0, [first])
    first.data = torch.empty(1)
    buf[:] = torch.full((32,), 3.0).numpy().tobytes()
    second = torch.frombuffer(buf, dtype=torch.float32).view(4, 8)  # same address, shape, version
    collector.add_local("actv", 0, ["b.input"], 0, [second])
    assert _norms(collector) == pytest.approx([math.sqrt(32), 3 * math.sqrt(32)])


def test_storage_released_with_resize_is_not_reused(addresses_collide):
    first = torch.empty(1024)
    first.fill_(1.0)
    collector = _collector()
    collector.add_local("actv", 0, ["a.output"], 0, [first])
    first.untyped_storage().resize_(0)  # FSDP's way to free memory; `first` stays alive
    second = torch.empty(1024)
    second.fill_(2.0)  # the same version count as `first` had
    assert second._version == first._version
    collector.add_local("actv", 0, ["b.input"], 0, [second])
    assert _norms(collector) == pytest.approx([32.0, 64.0])


def test_memory_of_a_dead_tensor_is_not_reused(addresses_collide):
    first = torch.empty(1024)
    first.fill_(1.0)
    collector = _collector()
    collector.add_local("actv", 0, ["a.output"], 0, [first])
    del first
    second = torch.empty(1024)
    second.fill_(2.0)
    collector.add_local("actv", 0, ["b.input"], 0, [second])
    assert _norms(collector) == pytest.approx([32.0, 64.0])


def test_the_same_live_tensor_is_still_reduced_once():
    t = torch.randn(64, 64)
    collector = _collector()
    engine = collector.engine
    collector.add_local("actv", 0, ["a.output"], 0, [t])
    calls = engine.calls
    collector.add_local("actv", 0, ["b.input"], 0, [t.view(-1)[: 64 * 64].view(64, 64)])  # a view of it
    assert engine.calls == calls  # reused, not computed
    first, second = _norms(collector)
    assert first == second


class Biased(nn.Module):
    """Megatron's skip_bias_add shape: returns its matmul and its bias Parameter, packed by `wrap`."""

    def __init__(self, wrap=lambda out, bias: (out, bias)) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4, bias=False)
        self.bias = nn.Parameter(torch.ones(4))
        self.wrap = wrap

    def forward(self, x):
        return self.wrap(self.w(x), self.bias)


def test_a_parameter_returned_as_an_output_gets_one_gradient_row_per_call(tmp_path, out_dir):
    """Megatron's skip_bias_add returns the bias Parameter itself as an output. A hook on the Parameter
    would fire for every later backward (every micro-batch's gradient under the same row) and would never
    be removed; the monitor hooks a view of it for each call instead."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = Biased()

        def forward(self, x):
            out, bias = self.lin(x)
            return (out + bias).sum()

    cfg = write_config(tmp_path / "c.json", xy_distribution=True, all_xy=True, ops=["norm"], ndigits=12)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt, grad_acc_steps=2)
    for _step in range(3):
        for micro in range(2):
            model(torch.full((3, 4), float(micro + 1))).backward()  # d(sum)/d(bias) = 3 per element
        opt.step()
        opt.zero_grad()
    monitor.close()
    rows = keyed(read_family(monitor.run_dir, "actv_grad"))
    for step in range(3):
        for micro in range(2):
            assert float(rows[("lin.output_1", step, micro)]["norm"]) == pytest.approx(6.0)
    assert not model.lin.bias._backward_hooks  # nothing left on the Parameter


@pytest.mark.parametrize("container", ["namedtuple", "return_types", "model_output", "ordered_dict"])
def test_a_parameter_output_keeps_its_container_type(tmp_path, out_dir, container):
    """The hooked view of a Parameter output goes back in a container of the output's own type: a plain
    dict in place of an HF ModelOutput broke `out.bias` in the training loop, and a namedtuple was not
    rebuilt at all (its gradient row was lost without a fault)."""
    import collections

    from transformers.utils import ModelOutput

    pair = collections.namedtuple("Pair", "out bias")

    @dataclasses.dataclass
    class Out(ModelOutput):
        out: torch.Tensor | None = None
        bias: torch.Tensor | None = None

    def wrap(out, bias):
        if container == "namedtuple":
            return pair(out, bias)
        if container == "return_types":  # a structseq, as torch.max(x, dim) returns
            return torch.return_types.max((out, bias))
        if container == "model_output":
            return Out(out=out, bias=bias)
        return collections.OrderedDict(out=out, bias=bias)

    model = nn.Sequential(Biased(wrap))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "c.json", xy_distribution=True, all_xy=True, ops=["norm"]))
    monitor.set_monitor(model, optimizer=opt)
    out = model(torch.ones(3, 4))
    assert type(out) is type(wrap(None, None))
    bias = out[1] if isinstance(out, tuple) else out["bias"]
    assert bias is not model[0].bias and torch.equal(bias, model[0].bias)  # this call's hooked view
    if container == "model_output":
        assert out.bias is bias
    ((out[0] if isinstance(out, tuple) else out["out"]) + bias).sum().backward()
    opt.step()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    rows = keyed(read_family(monitor.run_dir, "actv_grad"))
    label = "0.output_1"
    assert float(rows[(label, 0, 0)]["norm"]) == pytest.approx(
        3.0 * 2.0, rel=1e-6
    )  # 3 per element, 4 of them
