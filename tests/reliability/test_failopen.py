"""Failures inside the monitor are logged once, counted, and never reach the training loop."""

from __future__ import annotations

import logging

import torch
from torch import nn

import trainermon.exporters as exporters_pkg
from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.exporters.base import Exporter
from trainermon.exporters.csv import CsvExporter


def _model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps=4):
    losses = []
    for i in range(steps):
        x = torch.full((2, 4), float(i + 1))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _config(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    return write_config(
        tmp_path / "cfg.json",
        xy_distribution=True,
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        ops=["norm", "max"],
    )


class ExplodingExporter(Exporter):
    def __init__(self):
        self.calls = 0

    def write(self, batch):
        self.calls += 1
        raise OSError(28, "No space left on device")


def test_failing_sink_is_disabled_and_others_continue(tmp_path, monkeypatch, caplog):
    cfg = _config(tmp_path, monkeypatch)
    exploding = ExplodingExporter()

    def build(run, faults=None):
        csv = CsvExporter()
        csv.open(run)
        return [exploding, csv]

    monkeypatch.setattr(exporters_pkg, "build_exporters", build)
    model, opt = _model_and_opt()
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    with caplog.at_level(logging.ERROR, logger="trainermon"):
        _train(model, opt)
        monitor.close()
    assert exploding.calls == 1  # disabled after its first error
    assert monitor.faults.counts["exporter ExplodingExporter"] == 1
    errors = [r for r in caplog.records if "ExplodingExporter" in r.getMessage()]
    assert len(errors) == 1 and "disabled" in errors[0].getMessage()
    assert sorted({int(r["step"]) for r in read_family(monitor.run_dir, "grad_reduced")}) == [0, 1, 2, 3]


def test_raising_hooks_do_not_change_training(tmp_path, monkeypatch, caplog):
    cfg = _config(tmp_path, monkeypatch)
    model, opt = _model_and_opt()
    reference = _train(*_model_and_opt())

    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(monitor.loop.collector, "add", boom)
    monkeypatch.setattr(monitor.loop.collector, "add_whole", boom)
    monkeypatch.setattr(monitor.loop.collector, "add_local", boom)
    monkeypatch.setattr(monitor.loop.adapter, "read", boom)
    monkeypatch.setattr(monitor.loop.adapter, "read_whole", boom)
    with caplog.at_level(logging.ERROR, logger="trainermon"):
        losses = _train(model, opt)
    monitor.close()
    assert losses == reference  # the monitored run trained exactly like the unmonitored one
    assert monitor.faults.total >= 4
    assert {"forward hook", "optimizer pre-step", "optimizer post-step"} <= set(monitor.faults.counts)
    # logged once per place, however many times it failed
    assert caplog.text.count("error in forward hook") == 1


def test_unwritable_output_dir_does_not_stop_training(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the output directory should be")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(blocker))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True)
    model, opt = _model_and_opt()
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    losses = _train(model, opt)
    monitor.close()
    assert len(losses) == 4
    assert monitor.faults.total >= 1


def test_close_is_idempotent_and_hooks_are_removed(tmp_path, monkeypatch):
    cfg = _config(tmp_path, monkeypatch)
    model, opt = _model_and_opt()
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    _train(model, opt, steps=1)
    monitor.close()
    monitor.close()
    assert not monitor.loop.worker._thread.is_alive()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert all(not m._forward_hooks for m in model.modules())


def test_misread_tp_style_costs_the_labels_only(tmp_path, monkeypatch, caplog):
    """A style closure read wrongly (a torch or transformers version whose hooks look otherwise) raised
    out of set_monitor: the module's rows are written, unlabelled, and the failure is counted per module
    and logged once."""
    import trainermon.adapters.tp_styles as tp_styles

    def boom(module):
        raise AttributeError("'tuple' object has no attribute 'is_shard'")

    monkeypatch.setattr(tp_styles, "local_output_shards", boom)
    cfg = _config(tmp_path, monkeypatch)
    model, opt = _model_and_opt()
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.ERROR, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
        _train(model, opt, steps=2)
    monitor.close()
    assert dict(monitor.faults.counts) == {"activation shard labels": 3}  # the Linear, ReLU, Linear
    assert caplog.text.count("activation shard labels") == 1
    rows = read_family(monitor.run_dir, "actv")
    assert {r["name"] for r in rows} >= {"0.output", "2.output"} and all(r["shard"] == "" for r in rows)
