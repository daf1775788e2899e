"""Dynamic mode, a job rolled back to a checkpoint taken while it was collecting, after the monitor itself
wrote `dynamic_on: false` at the end of collect_times: the resumed run collects nothing (the file decides),
and says so at WARNING, naming the file, the saved count and collect_times (before: nothing at all, not even
at INFO, where an edit that stays on is said)."""

from __future__ import annotations

import json
import logging

import torch
from torch import nn

from tests.unit.dynamic_common import _collected_steps
from trainermon import TrainerMon

SAVE_AT, END = 4, 12  # the state saved after step 3; both runs end after step 11
CONFIG = {
    "wg_distribution": True,
    "ops": ["norm"],
    "dynamic_on": True,
    "collect_times": 5,
    "step_interval": 2,
}


def _steps(model, opt, steps: range) -> None:
    for _ in steps:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_rolled_back_run_that_finds_the_monitors_own_off_says_so(tmp_path, out_dir, dynamic_mode, caplog):
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(CONFIG))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = TrainerMon(str(path))
    first.set_monitor(model, optimizer=opt)
    _steps(model, opt, range(SAVE_AT))
    checkpoint = {"model": model.state_dict(), "opt": opt.state_dict(), "monitor": first.state_dict()}
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    _steps(model, opt, range(SAVE_AT, END))
    first.close()
    # The first run: 5 collections every 2 steps from step 0, then the monitor's own off in the file
    assert _collected_steps(out_dir) == [0, 2, 4, 6, 8]
    assert json.loads(path.read_text())["dynamic_on"] is False
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert saved["monitor"]["dynamic_on"] is True and saved["monitor"]["schedule_collected"] == 2

    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainermon"):
        second = TrainerMon(str(path))
        second.set_monitor(model, optimizer=opt, start_iteration=SAVE_AT)
        second.load_state_dict(saved["monitor"])
        _steps(model, opt, range(SAVE_AT, END))
        second.close()
    assert _collected_steps(out_dir) == [0, 2, 4, 6, 8]  # the file decides: nothing more
    said = [r for r in caplog.records if "now says dynamic_on false" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    text = said[0].getMessage()
    assert str(path) in text and "(2 steps collected; collect_times is 5 in the file now)" in text
    assert "until dynamic_on is set true" in text and "this job's own monitor" in text
    assert first.faults.total == 0 and second.faults.total == 0


def test_a_saved_state_that_was_off_says_nothing_more(tmp_path, out_dir, dynamic_mode, caplog):
    """Saved off and still off: nothing changed, nothing to say (the warning is for a rolled-back
    collection only)."""
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps({**CONFIG, "dynamic_on": False}))
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = TrainerMon(str(path))
    first.set_monitor(model, optimizer=opt)
    _steps(model, opt, range(SAVE_AT))
    state = first.state_dict()
    first.close()
    with caplog.at_level(logging.INFO, logger="trainermon"):
        second = TrainerMon(str(path))
        second.set_monitor(model, optimizer=opt, start_iteration=SAVE_AT)
        second.load_state_dict(state)
        _steps(model, opt, range(SAVE_AT, SAVE_AT + 2))
        second.close()
    assert "now says dynamic_on false" not in caplog.text
    assert _collected_steps(out_dir) == []


def test_a_static_mode_state_resumed_in_dynamic_mode_off_says_nothing(tmp_path, out_dir, monkeypatch, caplog):
    """A static-mode run whose config holds `dynamic_on: true` saves dynamic_on true: resumed in dynamic
    mode with the file off, it was told that its own monitor may have written that false (it never did)."""
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(CONFIG))
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    first = TrainerMon(str(path))
    first.set_monitor(model, optimizer=opt)
    _steps(model, opt, range(SAVE_AT))
    state = first.state_dict()
    first.close()
    assert state["dynamic_on"] is True and state["config_digest"] is None
    path.write_text(json.dumps({**CONFIG, "dynamic_on": False}))
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    with caplog.at_level(logging.INFO, logger="trainermon"):
        second = TrainerMon(str(path))
        second.set_monitor(model, optimizer=opt, start_iteration=SAVE_AT)
        second.load_state_dict(state)
        _steps(model, opt, range(SAVE_AT, SAVE_AT + 2))
        second.close()
    assert "now says dynamic_on false" not in caplog.text
    assert second.faults.total == 0
