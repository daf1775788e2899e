"""Resuming from `state_dict()`: what the saved state must carry, and what it may not do when malformed.

- Dynamic mode: the step_interval grid goes on from the saved run's anchor (before: re-anchored at the
  resumed step, [0, 3] + [5, 8, 11] for [0, 3, 6, 9]).
- Dynamic mode: a config edited while the job was down applies as a new one (before: the saved grid and
  count went on under it).
- Escalation requests the worker left before the save are applied after the resume, at the step they
  would have been without it (before: lost, then a step early).
- A malformed nested part (`escalation`, `detector`) is refused by `load_state_dict` itself, naming the
  key, and nothing is applied (before: accepted, then failing half-applied in `set_monitor`).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.helpers import write_config
from tests.unit.dynamic_common import BASE, _collected_steps
from trainermon import TrainerMon

CUT, END = 5, 12


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _run(monitor: TrainerMon, model, opt, steps: range) -> None:
    for _ in steps:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()


def _dynamic_first_run(tmp_path):
    """Steps 0 to CUT - 1 in dynamic mode, every 3rd step collected; the state saved at CUT."""
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps({**BASE, "dynamic_on": True, "step_interval": 3}))
    model, opt = _model()
    first = TrainerMon(str(path))
    first.set_monitor(model, optimizer=opt)
    _run(first, model, opt, range(CUT))
    state = first.state_dict()
    first.close()
    return path, model, opt, first, state


def test_a_resumed_dynamic_run_keeps_its_step_interval_grid(tmp_path, out_dir, dynamic_mode):
    path, model, opt, first, state = _dynamic_first_run(tmp_path)
    assert _collected_steps(out_dir) == [0, 3]
    second = TrainerMon(str(path))
    second.load_state_dict(state)
    second.set_monitor(model, optimizer=opt, start_iteration=CUT)
    _run(second, model, opt, range(CUT, END))
    second.close()
    assert first.faults.total == 0 and second.faults.total == 0
    assert _collected_steps(out_dir) == [0, 3, 6, 9]
    assert state["schedule_start"] == 0


def _resume(path, model, opt, state, order: str) -> TrainerMon:
    """The state loaded before `set_monitor`, or after it with or without `start_iteration` (Megatron's
    insertion passes none: the state's step is the only one)."""
    second = TrainerMon(str(path))
    if order == "before":
        second.load_state_dict(state)
    second.set_monitor(
        model, optimizer=opt, **({} if order == "after-no-start" else {"start_iteration": CUT})
    )
    if order != "before":
        second.load_state_dict(state)
    return second


ORDERS = ("before", "after", "after-no-start")


@pytest.mark.parametrize("order", ORDERS)
def test_a_config_edited_while_the_job_was_down_applies_as_new(
    tmp_path, out_dir, dynamic_mode, caplog, order
):
    """dynamic_on stays true but step_interval and collect_times changed: the new config runs from the
    resumed step, its collect_times counted from there, as an edit while running would (before: the saved
    grid and count went on under the new config: [6] for [5, 7, 9]; loaded after a `set_monitor` without
    `start_iteration`, the grid was anchored at step 0: [6, 8, 10])."""
    path, model, opt, first, state = _dynamic_first_run(tmp_path)
    path.write_text(json.dumps({**BASE, "dynamic_on": True, "step_interval": 2, "collect_times": 3}))
    with caplog.at_level("INFO", logger="trainermon"):
        second = _resume(path, model, opt, state, order)
    _run(second, model, opt, range(CUT, END))
    second.close()
    assert _collected_steps(out_dir) == [0, 3, 5, 7, 9]
    assert "changed since the state was saved" in caplog.text and second.faults.total == 0


def _escalated(monitor: TrainerMon, model, opt, steps: range) -> list[bool]:
    seen = []
    for step in steps:
        seen.append(monitor.loop.plan.escalating)
        _run(monitor, model, opt, range(step, step + 1))
    return seen


@pytest.mark.parametrize("loaded", ["before set_monitor", "after set_monitor"])
def test_escalation_requested_before_the_save_starts_where_it_would_have_without_it(
    tmp_path, out_dir, loaded
):
    """The worker's request left after step CUT's boundary applies at CUT + 1, resumed or not (before:
    lost; then, resumed, applied at CUT, a step early)."""
    config = write_config(tmp_path / "c.json", wg_distribution=True, ops=["norm"], collect_times=1)

    def first_part():
        model, opt = _model()
        monitor = TrainerMon(config)
        monitor.set_monitor(model, optimizer=opt)
        _run(monitor, model, opt, range(CUT))
        monitor.loop.escalation.request(2)  # as the worker does on an anomaly, before the next boundary
        return monitor, model, opt

    uninterrupted, model, opt = first_part()
    expected = _escalated(uninterrupted, model, opt, range(CUT, CUT + 4))
    uninterrupted.close()
    first, model, opt = first_part()
    state = first.state_dict()
    first.close()
    second = TrainerMon(config)
    if loaded == "before set_monitor":
        second.load_state_dict(state)
        second.set_monitor(model, optimizer=opt, start_iteration=CUT)
    else:
        second.set_monitor(model, optimizer=opt)
        second.load_state_dict(state)
    resumed = _escalated(second, model, opt, range(CUT, CUT + 4))
    second.close()
    assert expected == [False, True, True, False]
    assert resumed == expected
    assert state["escalation"]["pending"] == [2] and second.faults.total == 0


@pytest.mark.parametrize(
    "part, named",
    [
        ({"escalation": 5}, "'escalation' is 5"),
        ({"escalation": {"until": "7"}}, "'escalation.until' is '7'"),
        ({"escalation": {"until": 3, "pending": [0]}}, "'escalation.pending' is 0"),
        ({"detector": []}, "'detector' is []"),
        ({"detector": {"counts": {"AnomalyNan": "x"}}}, "'detector.counts'"),
        ({"detector": {"avg": {("a", "norm"): 1.0}}}, "'detector.avg'"),
        ({"detector": {"rolling": {("a",): (0, [1.0])}}}, "detector.rolling[('a',)]"),
        ({"dynamic_on": "yes"}, "'dynamic_on' is 'yes'"),
        ({"schedule_start": -2}, "'schedule_start' is -2"),
        ({"config_digest": 5}, "'config_digest' is 5"),
    ],
)
def test_a_malformed_nested_part_is_refused_before_anything_is_applied(tmp_path, out_dir, part, named):
    config = write_config(
        tmp_path / "c.json",
        wg_distribution=True,
        ops=["norm"],
        alert={"rules": [{"rule_name": "AnomalySpike", "args": {}}], "dump": False},
    )
    model, opt = _model()
    monitor = TrainerMon(config)
    good = monitor.state_dict()
    with pytest.raises(ValueError, match="allowed") as info:
        monitor.load_state_dict({**good, "step": 7, **part})  # before set_monitor: kept for it
    assert named in str(info.value), str(info.value)
    monitor.set_monitor(model, optimizer=opt)  # nothing half-applied: attaches as without the state
    assert monitor.current_step == 0 and monitor.faults.total == 0
    with pytest.raises(ValueError, match="allowed"):
        monitor.load_state_dict({**monitor.state_dict(), "step": 7, **part})  # after set_monitor
    assert monitor.current_step == 0
    _run(monitor, model, opt, range(2))
    monitor.close()
    assert monitor.current_step == 2 and monitor.faults.total == 0


@pytest.mark.parametrize("order", ORDERS)
def test_a_state_saved_before_pending_and_schedule_start_existed_still_loads(
    tmp_path, out_dir, dynamic_mode, order
):
    path, model, opt, first, state = _dynamic_first_run(tmp_path)
    del state["schedule_start"]
    state["escalation"] = {"until": CUT}  # the old layout: no queued requests
    second = _resume(path, model, opt, state, order)
    escalating = second.loop.plan.escalating
    _run(second, model, opt, range(CUT, END))
    second.close()
    assert escalating and second.faults.total == 0
    # No anchor saved: the grid starts again at the resumed step, as before the anchor was kept
    assert _collected_steps(out_dir) == [0, 3, 5, 8, 11]


def test_a_real_detector_state_passes_the_check_through_torch_save(tmp_path, out_dir):
    import io

    rules = [
        {"rule_name": "AnomalyTurbulence", "args": {}},
        {"rule_name": "AnomalySpike", "args": {"warmup": 2}},
        {"rule_name": "AnomalyUpdateRatio", "args": {}},
    ]
    config = write_config(
        tmp_path / "c.json",
        wg_distribution=True,
        update_distribution=True,
        ops=["norm", "mean"],
        alert={"rules": rules, "dump": False},
    )
    model, opt = _model()
    first = TrainerMon(config)
    first.set_monitor(model, optimizer=opt)
    _run(first, model, opt, range(CUT))
    state = first.state_dict()
    first.close()
    saved = state["detector"]
    assert saved["avg"] and saved["rolling"]  # tuple keys, (mean, n) and (window, [values]) entries
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    second = TrainerMon(config)
    second.load_state_dict(torch.load(buf, weights_only=True))
    second.set_monitor(model, optimizer=opt, start_iteration=CUT)
    assert second.loop.detector.state_dict() == saved
    second.close()
    assert second.faults.total == 0


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_state_through_dcp_loads_and_says_its_rule_history_is_gone(tmp_path, out_dir, caplog, order):
    """torch.distributed.checkpoint plans a load from the new monitor's own state_dict, whose rule history
    is empty, so none comes back: the load must work (model and monitor alike) and say so once; the
    torch.save path keeps the history and says nothing."""
    import io

    import torch.distributed.checkpoint as dcp

    rules = [{"rule_name": "AnomalySpike", "args": {"warmup": 2}}]
    config = write_config(
        tmp_path / "c.json", wg_distribution=True, ops=["norm"], alert={"rules": rules, "dump": False}
    )
    model, opt = _model()
    first = TrainerMon(config)
    first.set_monitor(model, optimizer=opt)
    _run(first, model, opt, range(CUT))
    first.close()
    dcp.save(
        {"model": model.state_dict(), "monitor": first}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True
    )
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)

    said = "holds no anomaly-rule history"
    for via in ("dcp", "torch.save"):
        caplog.clear()
        again, opt2 = _model()
        second = TrainerMon(config)
        with caplog.at_level("WARNING", logger="trainermon"):
            if order == "after":  # set_monitor opens the rules' (empty) windows: DCP must not ask for them
                second.set_monitor(again, optimizer=opt2)
            if via == "dcp":
                target = {"model": again.state_dict(), "monitor": second}
                dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
                again.load_state_dict(target["model"])
            else:
                buf.seek(0)
                second.load_state_dict(torch.load(buf, weights_only=True))
            if order == "before":
                second.set_monitor(again, optimizer=opt2)  # the state applies here
        assert second.loop.step == CUT
        for (name, p), q in zip(model.named_parameters(), again.parameters()):
            assert torch.equal(p, q) or via == "torch.save", name
        lines = [r.getMessage() for r in caplog.records if said in r.getMessage()]
        assert len(lines) == (1 if via == "dcp" else 0), (via, lines)
        second.close()


@pytest.mark.parametrize("rules", [None, [{"rule_name": "AnomalyNan", "args": {}}]])
def test_a_resume_without_rules_that_remember_says_nothing_of_a_history(tmp_path, out_dir, caplog, rules):
    """No rule keeps a history (no alert section, or AnomalyNan alone): nothing is lost, nothing said."""
    import io

    extra = {} if rules is None else {"alert": {"rules": rules, "dump": False}}
    config = write_config(tmp_path / "c.json", wg_distribution=True, ops=["norm"], **extra)
    model, opt = _model()
    first = TrainerMon(config)
    first.set_monitor(model, optimizer=opt)
    _run(first, model, opt, range(CUT))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    first.close()
    buf.seek(0)
    second = TrainerMon(config)
    second.set_monitor(model, optimizer=opt)
    with caplog.at_level("WARNING", logger="trainermon"):
        second.load_state_dict(torch.load(buf, weights_only=True))
    assert second.loop.step == CUT
    assert "anomaly-rule history" not in caplog.text, caplog.text
    second.close()


def test_a_state_loaded_before_set_monitor_is_kept_as_checked(tmp_path, out_dir):
    """The caller's dict changed between load_state_dict and set_monitor (a checkpoint dict reused): the
    state applied is the one checked. Before: kept by reference, the change skipped the check and failed
    in set_monitor."""
    config = write_config(tmp_path / "c.json", wg_distribution=True, ops=["norm"])
    model, opt = _model()
    monitor = TrainerMon(config)
    state = {**monitor.state_dict(), "step": 7}
    monitor.load_state_dict(state)
    state["step"], state["escalation"] = "seven", "bad"
    monitor.set_monitor(model, optimizer=opt)
    assert monitor.current_step == 7 and monitor.faults.total == 0
    monitor.close()


def test_a_start_iteration_other_than_the_states_step_is_said(tmp_path, out_dir, dynamic_mode, caplog):
    """The state's step numbers the run; a `start_iteration` that disagrees (a state from another
    checkpoint than the model's) used to pass silently. The same step, or none given (also after a few
    steps ran: the review found those steps taken for a start_iteration), says nothing."""
    path, model, opt, first, state = _dynamic_first_run(tmp_path)
    for start, said in ((CUT + 2, True), (CUT, False), (0, False), (None, False)):
        second = TrainerMon(str(path))
        second.set_monitor(model, optimizer=opt, **({} if start is None else {"start_iteration": start}))
        if start is None:
            _run(second, model, opt, range(3))
        caplog.clear()
        with caplog.at_level("WARNING", logger="trainermon"):
            second.load_state_dict(state)
        assert second.loop.step == CUT
        second.close()
        assert ("differs from the saved state's step 5" in caplog.text) == said, (start, caplog.text)
