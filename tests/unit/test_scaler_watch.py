"""The loss-scaler watch (runtime/scaler_watch.py): which skipped steps are a scaler's routine overflow.

- A loop that unscales, clips, and skips `scaler.step` on a non-finite norm skips for the scaler's
  overflow: flagged skipped, no AnomalyNan (before: each such overflow was the loop's own skip, ~20
  anomaly records each).
- A fused optimizer (CPU fused Adam) is always stepped by the scaler and skips in its kernel: the step is
  flagged skipped from the scaler's found_inf (before: never flagged).
- Another tool's wrapper of `GradScaler.step`, put on while the monitor watches, survives close()
  (before: removed, because functools.wraps copied our marker onto it).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from tests.helpers import read_family, write_config
from tests.unit.test_anomaly_own_skip import _nan_records
from trainermon import TrainerMon
from trainermon.runtime import scaler_watch

OVERFLOW, ITERATIONS = 2, 4


def _config(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    return write_config(
        tmp_path / "c.json",
        targets={},
        wg_distribution=True,
        ops=["norm", "nans"],
        format="csv",
        alert={"rules": [{"rule_name": "AnomalyNan", "args": {}}], "dump": True},
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _skipped_by_step(monitor) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for row in read_family(monitor.run_dir, "grad_reduced"):
        out.setdefault(int(row["step"]), set()).add(row["skipped"])
    return out


def test_unscale_then_skipping_on_a_nonfinite_clip_norm_is_the_scalers_overflow(tmp_path, monkeypatch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(_config(tmp_path, monkeypatch))
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    stepped = []
    for it in range(ITERATIONS):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        if it == OVERFLOW:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isfinite(norm):  # the loop's guard: scaler.step only on a finite norm
            scaler.step(opt)
        stepped.append(bool(torch.isfinite(norm)))
        scaler.update()
        opt.zero_grad()
    monitor.close()
    assert stepped == [True, True, False, True]
    assert scaler.get_scale() < 2.0**10  # the overflow was found and backed off
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert _skipped_by_step(monitor)[OVERFLOW] == {"1"}
    assert _nan_records(tmp_path) == {}  # a routine overflow: no anomaly


def test_the_same_loop_skipping_on_its_own_finite_reason_is_still_its_own_skip(tmp_path, monkeypatch):
    """unscale_ found nothing (finite gradients), yet the loop skipped and its gradients hold NaN it put
    there after unscaling: the loop's own skip, reported."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(_config(tmp_path, monkeypatch))
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for it in range(ITERATIONS):
        scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
        scaler.unscale_(opt)
        if it == OVERFLOW:
            model[0].weight.grad[0, 0] = math.nan  # after unscale_: the scaler never saw it
        else:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    monitor.close()
    got = _nan_records(tmp_path)
    assert set(got) == {OVERFLOW} and ("grad_reduced", "0.weight", "nans") in got[OVERFLOW], got


def test_a_fused_optimizers_skipped_update_is_flagged(tmp_path, monkeypatch):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(_config(tmp_path, monkeypatch))
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    before = {}
    for it in range(ITERATIONS):
        before[it] = [p.detach().clone() for p in model.parameters()]
        loss = model(torch.randn(3, 4)).pow(2).mean()
        if it == OVERFLOW:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    for a, b in zip(before[OVERFLOW], before[OVERFLOW + 1], strict=True):
        assert torch.equal(a, b)  # the kernel skipped the update
    assert not torch.equal(before[0][0], before[1][0])  # ... and made the others
    assert _skipped_by_step(monitor) == {0: {"0"}, 1: {"0"}, OVERFLOW: {"1"}, 3: {"0"}}
    assert _nan_records(tmp_path) == {}


def test_another_tools_scaler_wrapper_survives_close(tmp_path, monkeypatch):
    base = torch.amp.GradScaler
    original, original_unscale = base.__dict__["step"], base.__dict__["unscale_"]
    model = _model()
    monitor = TrainerMon(_config(tmp_path, monkeypatch))
    monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ours = base.__dict__["step"]
    assert ours is not original and base.__dict__["unscale_"] is not original_unscale
    calls = []

    @functools.wraps(ours)  # copies every attribute of ours, as a profiler's wrapper would
    def theirs(self, optimizer, *args, **kwargs):
        calls.append(1)
        return ours(self, optimizer, *args, **kwargs)

    monkeypatch.setattr(base, "step", theirs)
    monitor.close()
    assert base.__dict__["step"] is theirs  # not removed under the other tool
    assert not scaler_watch._LISTENERS and not scaler_watch._WRAPPED
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.step(opt)  # theirs -> ours (no listener: calls through) -> torch's
    assert calls == [1]
    assert base.__dict__["unscale_"] is original_unscale  # ours, still in place: put back


def test_another_optimizers_overflow_on_the_same_scaler_explains_nothing(tmp_path, monkeypatch):
    """One scaler, two optimizers: `other` overflows, the monitored one is finite but the loop skips it on
    a NaN of its own. `update()` adds `other`'s found_inf into the first optimizer's tensor in place; the
    probe's copy still says the monitored optimizer found nothing: its own skip, reported."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    weight = nn.Parameter(torch.ones(2))
    other = torch.optim.SGD([weight], lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(_config(tmp_path, monkeypatch))
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for it in range(ITERATIONS):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        scaler.scale(loss + (weight.sum() * (math.inf if it == OVERFLOW else 1.0))).backward()
        scaler.unscale_(opt)  # first: its found_inf is the tensor update() adds into
        if it == OVERFLOW:
            model[0].weight.grad[0, 0] = math.nan
        else:
            scaler.step(opt)
        scaler.step(other)
        scaler.update()
        opt.zero_grad()
        other.zero_grad()
    monitor.close()
    assert scaler.get_scale() < 2.0**10  # `other` overflowed
    got = _nan_records(tmp_path)
    assert set(got) == {OVERFLOW} and ("grad_reduced", "0.weight", "nans") in got[OVERFLOW], got


_LATE_SCALER = """
import math, sys
import torch, torch.distributed as dist
from torch import nn
from trainermon import TrainerMon
from tests.helpers import read_family

dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
assert "torch.distributed.fsdp.sharded_grad_scaler" not in sys.modules
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
monitor = TrainerMon(sys.argv[1])
monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # after set_monitor

scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10)
for it in range(4):
    loss = model(torch.randn(3, 4)).pow(2).mean() * (math.inf if it == 2 else 1.0)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # ShardedGradScaler's own, not the base class's
    if torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
        scaler.step(opt)
    scaler.update()
    opt.zero_grad()
monitor.close()
print(sorted({(int(r["step"]), r["skipped"]) for r in read_family(monitor.run_dir, "grad_reduced")}))
dist.destroy_process_group()
"""


def test_a_scaler_class_loaded_after_set_monitor_is_watched(tmp_path, monkeypatch):
    """FSDP's ShardedGradScaler, imported after set_monitor (`import torch.distributed.fsdp` does not load
    it), defines its own `unscale_`: its overflow is still the scaler's (skipped 1, no AnomalyNan). Before,
    only the classes loaded at set_monitor were wrapped: skipped 2 and 11 AnomalyNan records. In a fresh
    process, where the class is not loaded yet."""
    import os
    import subprocess
    import sys

    config = _config(tmp_path, monkeypatch)
    script = tmp_path / "late.py"
    script.write_text(_LATE_SCALER)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo}
    out = subprocess.run(
        [sys.executable, str(script), config, str(tmp_path / "store")],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[(0, ''), (1, ''), (2, '1'), (3, '')]", out.stdout
    assert _nan_records(tmp_path) == {}
