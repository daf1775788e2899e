"""Where hook rows are reduced (StepCollector.add_local / flush).

Tensors the native kernel reads are reduced at their hook, into the step's row table: exact, with the
values they had at the hook whatever happens to them later, nothing held. Elsewhere (accelerators, other
dtypes, no kernel: checked here with the kernel off, the path an accelerator takes) they are recorded by
reference and reduced in batches. Checks against references computed in the test: batched rows are exact,
a model with many modules costs a few engine calls per step instead of one per hook, a tensor changed in
place after its hook is never reported with its new values (learned on the first step; on a
data-dependent path, the row is dropped and counted, then reduced at its hook), a tensor whose memory is
swapped (`.data = `) is reduced from the values it had, and the memory held for a batch stays bounded.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon
from trainermon.collect.batch import ACCELERATOR_HOLD_BYTES, HOLD_BYTES, HookBatch, hold_limit
from trainermon.collect.collector import StepCollector, TransferCounter
from trainermon.collect.records import StepScalars
from trainermon.config import MonitorConfig
from trainermon.failsafe import FaultLog
from trainermon.stats import INFS, NANS, EngineOptions, StatsEngine, fused


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(nn.functional.gelu(self.norm(x)))


class Flaky(nn.Module):
    """Rewrites its child's output in place after the child's hook, on its third call only."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.child = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.child(x)
        self.calls += 1
        if self.calls == 3:
            h.mul_(2.0)
        return x + h


class Net(nn.Module):
    def __init__(self, d: int = 16, layers: int = 12) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(layers)))
        self.flaky = Flaky(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flaky(self.blocks(x))


def _stats(t: torch.Tensor) -> dict[str, float]:
    x = t.detach().double()
    return {"norm": float(x.norm()), "min": float(x.min()), "max": float(x.max()), "mean": float(x.mean())}


@pytest.mark.parametrize("path", ["batched", "at-hook"])
def test_hook_rows_are_exact_and_batches_cost_few_engine_calls(tmp_path, monkeypatch, path):
    if path == "at-hook" and not fused.AVAILABLE:
        pytest.skip(f"the native kernel is needed for rows written at the hook: {fused.KIND}")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "c.json", xy_distribution=True, all_xy=True, ops=["norm", "min", "max", "mean"]
    )
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reference: list[dict[str, dict[str, float]]] = []  # per step: output name -> statistics at hook time

    def keep(name):
        def hook(module, args, output):
            reference[-1][f"{name}.output"] = _stats(output)

        return hook

    for name, module in model.named_modules():
        if name:  # registered before the monitor's hooks: they see each output first
            module.register_forward_hook(keep(name))
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    engine = monitor.loop.engine
    if path == "batched":  # what an accelerator does: no native kernel
        engine.options = dataclasses.replace(engine.options, fused=False)
    assert engine.writes_rows_directly() == (path == "at-hook")
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    calls = []
    for _ in range(4):
        reference.append({})
        before = engine.calls
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        calls.append(engine.calls - before)
    faults = dict(monitor.loop.faults.counts)
    monitor.close()

    rows = keyed(read_family(monitor.run_dir, "actv"))
    steps = sorted({step for _, step, _ in rows})
    assert len(steps) == 4
    outputs = sorted(reference[0])
    assert len(outputs) == 12 * 3 + 3  # every block, its norm and fc, the Sequential, flaky and its child
    for i, step in enumerate(steps):
        for name in outputs:
            if i == 2 and name == "flaky.child.output" and path == "batched":
                assert (name, step, 0) not in rows  # changed after its batched hook: dropped, not wrong
                continue
            got = rows[(name, step, 0)]
            for op, want in reference[i][name].items():
                assert float(got[op]) == pytest.approx(want, rel=1e-5, abs=1e-6), (
                    name,
                    step,
                    op,
                )  # CSV: 6 digits
    if path == "at-hook":  # read at the hook (the in-place change came later): exact, nothing dropped
        assert faults.get("tensor changed after its hook") is None
        assert min(calls) > 60  # one kernel call per distinct tensor
        return
    assert faults.get("tensor changed after its hook") == 1
    # Step 0 learns (one engine call per hook, as without batching); later steps batch the trusted
    # tensors: about 150 rows per step (forward and backward), a handful of engine calls.
    assert calls[0] > 60
    assert max(calls[1:]) <= 12, calls


def _collector(kernel: bool = False) -> tuple[StepCollector, StatsEngine, FaultLog]:
    engine = StatsEngine(EngineOptions(nonfinite=False, fused=kernel))
    faults = FaultLog()
    return StepCollector(engine, TransferCounter(), faults), engine, faults


def _learn(collector: StepCollector, labels: list[str], like: torch.Tensor) -> None:
    for label in labels:
        collector.add_local("actv", 0, [label], 0, [like.clone()])
    collector.finish(0, StepScalars())


def test_memory_swapped_after_the_hook_keeps_the_hooks_values():
    """Megatron frees a pipeline output with `out.data = torch.empty(1)` once it is sent: the batched row
    is reduced from the values the tensor had at its hook."""
    collector, _, faults = _collector()
    _learn(collector, ["a.output"], torch.ones(64))
    t = torch.full((64,), 3.0)
    collector.add_local("actv", 0, ["a.output"], 0, [t])
    t.data = torch.empty(1)
    payload = collector.finish(1, StepScalars())
    assert payload.partials[0, 0].sqrt().item() == pytest.approx(3.0 * 8.0)
    assert faults.total == 0


def test_in_place_change_after_a_batched_hook_drops_the_row_then_reduces_at_the_hook():
    collector, _, faults = _collector()
    _learn(collector, ["a.output"], torch.ones(64))
    t = torch.full((64,), 3.0)
    collector.add_local("actv", 0, ["a.output"], 0, [t])
    t.add_(1.0)  # after the hook, before the batch is reduced
    payload = collector.finish(1, StepScalars())
    assert math.isnan(payload.partials[0, NANS].item())  # the worker drops such a row
    assert faults.counts["tensor changed after its hook"] == 1
    t = torch.full((64,), 3.0)
    collector.add_local("actv", 0, ["a.output"], 0, [t])
    t.add_(1.0)
    payload = collector.finish(2, StepScalars())
    assert payload.partials[0, 0].sqrt().item() == pytest.approx(3.0 * 8.0)  # reduced at its hook now
    assert payload.partials[0, NANS].item() == 0


def test_held_memory_is_bounded_and_batches_share_engine_calls():
    collector, engine, _ = _collector()
    labels = [f"m{i}.output" for i in range(64)]
    _learn(collector, labels, torch.ones(16 * 1024))  # 64 KiB each
    before = engine.calls
    tensors = [torch.full((16 * 1024,), float(i)) for i in range(64)]  # 4 MiB in all
    for label, t in zip(labels, tensors):
        collector.add_local("actv", 0, [label], 0, [t])
        assert collector._held <= HOLD_BYTES
    payload = collector.finish(1, StepScalars())
    assert engine.calls - before <= 4 * 1024 * 1024 // HOLD_BYTES + 1
    norms = payload.partials[:, 0].sqrt().tolist()
    assert norms == pytest.approx([i * 128.0 for i in range(64)])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_accelerator_holds_more_per_batch_than_the_cpu(device):
    """On a GPU each engine call costs ~100 us of host time and activations are tens of MiB, so hook
    tensors there are held up to `ACCELERATOR_HOLD_BYTES` (the CPU keeps its cache-sized hold): 64
    tensors of 1 MiB are one engine call on CUDA, about 22 on the CPU, with the same exact rows."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the CPU stand-in for the choice of limit is the next test)")
    collector, engine, faults = _collector()
    labels = [f"m{i}.output" for i in range(64)]
    _learn(collector, labels, torch.ones(256 * 1024, device=device))  # 1 MiB each
    before = engine.calls
    tensors = [torch.full((256 * 1024,), float(i), device=device) for i in range(64)]  # 64 MiB in all
    limit = HOLD_BYTES if device == "cpu" else ACCELERATOR_HOLD_BYTES
    for label, t in zip(labels, tensors):
        collector.add_local("actv", 0, [label], 0, [t])
        assert collector._held <= limit
    payload = collector.finish(1, StepScalars())
    calls = engine.calls - before
    if device == "cpu":
        # a batch is reduced once it holds more than the limit: at most the limit plus one tensor
        assert 64 * 2**20 // (HOLD_BYTES + 2**20) <= calls <= 64 * 2**20 // HOLD_BYTES + 1
    else:
        assert calls == 1  # everything held until the step's end
    norms = payload.partials[:, 0].sqrt().tolist()
    assert norms == pytest.approx([i * 512.0 for i in range(64)])
    assert faults.total == 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_zero_hold_reduces_each_hooks_tensors_before_it_returns(device):
    """`accelerator_hold_mib: 0`: nothing is held past the hook call, one engine call per call. On the CPU
    the CPU's limit set to 0 stands in for it (the same check; the device only picks which limit)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the CPU runs the same check with its own limit at 0)")
    collector, engine, faults = _collector()
    if device == "cpu":
        collector.hold_bytes = 0
    else:
        collector.hold_bytes_accelerator = 0
    labels = [f"m{i}.output" for i in range(8)]
    _learn(collector, labels, torch.ones(1024, device=device))
    before = engine.calls
    for i, label in enumerate(labels):
        collector.add_local("actv", 0, [label], 0, [torch.full((1024,), float(i), device=device)])
        assert collector._held == 0
    payload = collector.finish(1, StepScalars())
    assert engine.calls - before == len(labels)
    assert payload.partials[:, 0].sqrt().tolist() == pytest.approx([i * 32.0 for i in range(8)])
    assert faults.total == 0


def test_the_config_sets_the_accelerator_hold(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = nn.Linear(4, 4)
    assert MonitorConfig().accelerator_hold_mib << 20 == ACCELERATOR_HOLD_BYTES
    for mib, want in ((None, ACCELERATOR_HOLD_BYTES), (0, 0), (16, 16 << 20)):
        extra = {} if mib is None else {"accelerator_hold_mib": mib}
        cfg = write_config(tmp_path / f"c{mib}.json", xy_distribution=True, **extra)
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model)
        assert monitor.loop.collector.hold_bytes_accelerator == want
        assert monitor.loop.collector.hold_bytes == HOLD_BYTES  # the CPU's stays
        monitor.close()


def test_the_hold_limit_follows_the_batchs_device():
    """CPU stand-in for the CUDA case above: the limit is chosen by the device of the batch's tensors
    (a meta tensor stands for an accelerator's; nothing is computed from it)."""
    batch = HookBatch()
    assert hold_limit(batch, 1, 2) == 1  # empty: the CPU's, until a tensor decides
    batch.tensors.append(torch.empty(4, device="meta"))
    assert hold_limit(batch, 1, 2) == 2
    assert hold_limit(batch, 2 << 20, 0) == 0  # `accelerator_hold_mib: 0` is not raised to the CPU's
    batch.tensors[0] = torch.empty(4)
    assert hold_limit(batch, 1, 2) == 1


@pytest.mark.skipif(not fused.AVAILABLE, reason=f"native kernel: {fused.KIND}")
def test_rows_written_at_the_hook_keep_the_hooks_values_and_hold_nothing():
    """With the kernel, a hook's tensors are reduced at once into the row table (which grows past its first
    256 rows): an in-place change, a swapped memory or a NaN after the hook changes nothing, and no tensor
    is kept alive for a batch."""
    collector, engine, faults = _collector(kernel=True)
    tensors = [torch.full((100,), float(i)) for i in range(300)]
    before = engine.calls
    for i, t in enumerate(tensors):
        collector.add_local("actv", 0, [f"m{i}.output"], 0, [t])
        assert collector._held == 0 and not collector._batch.tensors
    assert engine.calls - before == 300
    tensors[0].add_(1.0)
    tensors[1].data = torch.empty(1)
    tensors[2][0] = float("nan")
    payload = collector.finish(0, StepScalars())
    assert payload.partials[:, 0].sqrt().tolist() == pytest.approx([i * 10.0 for i in range(300)])
    assert payload.partials[:, 2].tolist() == [float(i) for i in range(300)]  # min
    assert payload.partials[:, NANS].sum().item() == 0
    assert [row.name for row in payload.rows] == [f"m{i}.output" for i in range(300)]
    assert faults.total == 0


@pytest.mark.skipif(not fused.AVAILABLE, reason="the row table is written by the native kernel")
def test_row_table_grows_and_keeps_every_row():
    """The table doubles when full and keeps the rows written before; a tensor the kernel cannot read
    takes no row. Sums of squares within the kernel's 9.6e-7 relative bound (`_fused.c`), checked at 2e-6."""
    from trainermon.collect.batch import RowTable
    from trainermon.stats import SUMSQ

    engine = StatsEngine(EngineOptions(nonfinite=True))
    table = RowTable(capacity=2)
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(10 + i, generator=gen) for i in range(5)]
    assert table.write(engine, torch.arange(4)) is None  # an integer tensor: not the kernel's
    rows = [table.write(engine, t) for t in tensors]
    assert rows == [0, 1, 2, 3, 4] and table.capacity == len(table.result) == 8
    for row, t in zip(rows, tensors):
        exact = float(t.double().square().sum())
        assert math.isclose(float(table.result[row, SUMSQ]), exact, rel_tol=2e-6)


def test_copies_of_graph_tensors_stay_within_the_hold(monkeypatch):
    """A compiled graph's tap passes its tensors in one call, copied into the batch where no kernel reads
    them at the hook (a GPU's path; here the CPU's with no kernel). The copies are new memory: the batch is
    reduced before a copy would take it past the hold, not after the call. Four taps of four 1 MiB
    tensors under a 1 MiB hold: at most 1 MiB of copies alive, every row exact."""
    from trainermon.collect import hook_rows

    peak = [0]
    real = hook_rows.reduce_held

    def held(engine, batch, *args):
        peak[0] = max(peak[0], sum(t.numel() * t.element_size() for t in batch.tensors))
        return real(engine, batch, *args)

    monkeypatch.setattr(hook_rows, "reduce_held", held)
    collector, engine, faults = _collector(kernel=False)
    collector.hold_bytes = 1 << 20
    mib = 1 << 18  # float32 elements in 1 MiB
    for tap in range(4):
        tensors = [torch.full((mib,), float(4 * tap + j)) for j in range(4)]
        collector.add_local("actv", 0, [f"m{tap}.{j}" for j in range(4)], 0, tensors, transient=True)
    payload = collector.finish(0, StepScalars())
    assert 0 < peak[0] <= 1 << 20, peak[0]
    # each row sqrt(sum of squares) = value x sqrt(2^18) = value x 512
    assert payload.partials[:, 0].sqrt().tolist() == [512.0 * k for k in range(16)]
    assert faults.total == 0


@pytest.mark.parametrize("first", ["inference", "training"])
@pytest.mark.parametrize("hold", [HOLD_BYTES, 0])
def test_graph_tensors_under_inference_mode(first, hold):
    """A compiled forward under `torch.inference_mode()` with the model in train mode (a rollout): its
    tap's tensors are reduced at once, not copied (a copy made there has no version counter for the
    batch's check), and neither order of inference and training calls leaves the engine a buffer the other
    mode cannot write. Before: every row of the step was lost to a fault."""
    collector, _, faults = _collector(kernel=False)
    collector.hold_bytes = hold

    def training() -> None:
        collector.add_local("actv", 0, ["a.output"], 0, [torch.full((64,), 2.0)], transient=True)

    def inference() -> None:
        with torch.inference_mode():
            collector.add_local("actv", 0, ["b.output"], 0, [torch.full((64,), 3.0)], transient=True)

    for call in (inference, training) if first == "inference" else (training, inference):
        call()
    payload = collector.finish(0, StepScalars())
    norms = dict(zip((row.name for row in payload.rows), payload.partials[:, 0].sqrt().tolist()))
    assert norms == {"a.output": 2.0 * 8, "b.output": 3.0 * 8}, norms
    assert faults.total == 0


@pytest.mark.skipif(not fused.AVAILABLE, reason="the row table is written by the native kernel")
@pytest.mark.parametrize("how", ["grown", "made"])
def test_a_row_table_from_inference_mode_takes_training_rows(how):
    """The step's row table grown (a rollout of 300 rows) or made (a step ending there) under
    `torch.inference_mode()` still takes the next training rows, a non-finite one included (recomputed
    into the table in place). Before: an inference tensor, and every later hook a fault."""
    faults = FaultLog()
    collector = StepCollector(StatsEngine(EngineOptions(nonfinite=True)), TransferCounter(), faults)
    with torch.inference_mode():
        count = 300 if how == "grown" else 1
        for i in range(count):
            collector.add_local("actv", 0, [f"r{i}"], 0, [torch.full((64,), 1.0 + i)], transient=True)
        if how == "made":
            collector.finish(0, StepScalars())  # the next step's table is made here
    bad = torch.full((64,), 2.0)
    bad[3] = float("inf")
    collector.add_local("actv", 0, ["train.output"], 0, [bad])
    payload = collector.finish(1, StepScalars())
    assert payload.rows[-1].name == "train.output" and faults.total == 0
    row = payload.partials[-1]
    assert row[INFS].item() == 1 and row[0].item() == pytest.approx(63 * 4.0)  # sumsq of the finite values
