"""AnomalyNan on a step the training loop skipped itself (no loss scaler): its NaN gradients are reported.

The skip probe closes any iteration with a backward but no optimizer step as its own step, flagged
`skipped`. Only a skip a loss scaler's `step` explains exempts the step's gradients from AnomalyNan; a loop
that checks its own gradients and skips `optimizer.step()` on a NaN must see that NaN reported.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.pipeline.anomaly import GLOBAL_NORM, load_anomalies
from trainermon.runtime import scaler_watch, skips

NAN_STEP = 2


def _config(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    return write_config(
        tmp_path / "c.json",
        targets={},
        xy_distribution=True,
        wg_distribution=True,
        ops=["norm", "nans"],
        format=["csv", "parquet"],
        alert={"rules": [{"rule_name": "AnomalyNan", "args": {}}], "dump": True},
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _nan_records(tmp_path) -> dict[int, set[tuple[str, str, str]]]:
    by_step: dict[int, set[tuple[str, str, str]]] = {}
    for r in load_anomalies(str(tmp_path / "out")):
        assert r["rule"] == "AnomalyNan"
        by_step.setdefault(r["step"], set()).add((r["family"], r["name"], r["stat"]))
    return by_step


def test_a_loop_skipping_its_own_step_on_nan_grads_is_a_nan_anomaly(tmp_path, monkeypatch):
    """No GradScaler: the loop checks its gradients, and at step 2 (NaN loss, NaN gradients) skips
    `optimizer.step()` and clears them. The step is still its own, flagged skipped, but its NaN gradients
    are AnomalyNan records: each parameter's grad_reduced, the global norm; no other step has any."""
    config = _config(tmp_path, monkeypatch)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    stepped = []
    for step in range(4):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        if step == NAN_STEP:
            loss = loss * float("nan")
        loss.backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        if finite:  # the loop's own guard: no step on a non-finite gradient
            opt.step()
        stepped.append(finite)
        opt.zero_grad()
    monitor.close()
    assert stepped == [True, True, False, True]
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    skipped = {int(r["step"]): r["skipped"] for r in read_family(monitor.run_dir, "grad_reduced")}
    # CSV: 2, the loop's own skip (a scaler's is 1); Parquet: skipped and own_skip
    assert skipped[NAN_STEP] == "2" and skipped[1] == "" and skipped[3] == "", skipped
    import trainermon

    table = trainermon.load(str(tmp_path / "out"), family="grad_reduced", as_pandas=True)
    flags = table.groupby("step")[["skipped", "own_skip"]].agg(lambda v: set(v.tolist()))
    assert flags.loc[NAN_STEP, "skipped"] == {True} and flags.loc[NAN_STEP, "own_skip"] == {True}, flags
    assert all(flags.loc[s, "own_skip"] == {None} for s in (0, 1, 3)), flags
    from trainermon.cli import main  # CSV converted to Parquet: the same flags

    assert main(["convert", monitor.run_dir, str(tmp_path / "converted")]) == 0
    converted = trainermon.load(str(tmp_path / "converted"), family="grad_reduced", as_pandas=True)
    again = converted.groupby("step")[["skipped", "own_skip"]].agg(lambda v: set(v.tolist()))
    assert again.to_dict() == flags.to_dict()
    by_step = _nan_records(tmp_path)
    assert set(by_step) == {NAN_STEP}, by_step
    got = by_step[NAN_STEP]
    names = [n for n, _ in model.named_parameters()]
    assert {("grad_reduced", n, "nans") for n in names} <= got, got
    assert ("grad_reduced", GLOBAL_NORM, "norm") in got
    assert any(family == "actv_grad" for family, _, _ in got), got


def test_a_scaler_step_on_another_optimizer_explains_nothing(tmp_path, monkeypatch):
    """A GradScaler stepping some other optimizer in the same iteration does not make the monitored
    optimizer's own skip the scaler's."""
    config = _config(tmp_path, monkeypatch)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    weight = nn.Parameter(torch.ones(2))
    other = torch.optim.SGD([weight], lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    monitor = TrainerMon(config)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(3):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        if step == NAN_STEP:
            loss = loss * float("nan")
        loss.backward()
        scaler.scale(weight.sum()).backward()
        scaler.step(other)  # finite: `other` steps
        scaler.update()
        other.zero_grad()
        if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            opt.step()
        opt.zero_grad()
    monitor.close()
    got = _nan_records(tmp_path)
    assert set(got) == {NAN_STEP} and ("grad_reduced", GLOBAL_NORM, "norm") in got[NAN_STEP], got


def test_the_scaler_wrapper_lives_while_a_probe_is_attached(tmp_path, monkeypatch):
    """`GradScaler.step` is wrapped while any monitor's probe is attached and put back when the last one
    is closed; the CUDA and FSDP scalers inherit the one `step` (or are wrapped themselves)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    config = _config(tmp_path, monkeypatch)
    base = torch.amp.GradScaler
    original = base.__dict__["step"]
    for cls in (torch.cuda.amp.GradScaler, ShardedGradScaler):
        assert "step" not in cls.__dict__ or cls in scaler_watch._scaler_classes("step")
    monitors = []
    for _ in range(2):
        model = _model()
        monitor = TrainerMon(config)
        monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        monitors.append(monitor)
    wrapped = base.__dict__["step"]
    assert wrapped is not original and wrapped.__wrapped__ is original
    monitors[0].close()
    assert base.__dict__["step"] is wrapped  # the second monitor still watches
    monitors[1].close()
    assert base.__dict__["step"] is original and not scaler_watch._LISTENERS and not scaler_watch._WRAPPED


def test_the_scaler_wrapper_never_raises_into_the_loop(tmp_path, monkeypatch):
    """A failing probe is passed over: the scaler's step runs (and updates) as without the monitor."""
    config = _config(tmp_path, monkeypatch)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=opt)

    def broken(self, optimizer):
        raise RuntimeError("probe bug")

    monkeypatch.setattr(skips.SkippedStepProbe, "scaler_step", broken)
    scaler = torch.amp.GradScaler("cpu")
    before = model[0].weight.detach().clone()
    scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    monitor.close()
    assert not torch.equal(before, model[0].weight.detach())
