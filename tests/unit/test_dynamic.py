"""Dynamic start/stop (DYNAMIC_MONITOR=true): the user guide's scenarios, edits, deleted files, resumes."""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.unit.dynamic_common import BASE, _collected_steps, _train, _wait_dirty
from trainermon import TrainerMon
from trainermon.runtime.control import update_config_file

# Edits are made "before step i" (before its forward); the watcher flags them within milliseconds and the
# new config applies at the next step boundary, i.e. from step i + 1 on.


def _edit(path: str, **changes) -> Callable[[TrainerMon], None]:
    def act(monitor: TrainerMon) -> None:
        update_config_file(path, **changes)
        _wait_dirty(monitor)

    return act


@pytest.fixture
def dyn(tmp_path, out_dir, dynamic_mode):
    out = out_dir

    def make(**keys) -> str:
        path = tmp_path / "monitor_config.json"
        path.write_text(json.dumps({**BASE, **keys}))
        return str(path)

    return make, str(out)


def test_static_mode_ignores_edits(tmp_path, static_mode, out_dir):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**BASE, "collect_times": 2}))

    def edit(_monitor):
        update_config_file(str(path), collect_times=100)
        time.sleep(0.05)

    monitor = _train(str(path), 5, {1: edit})
    assert monitor.loop.control is None
    assert _collected_steps(str(tmp_path / "out")) == [0, 1]


def test_dynamic_off_collects_nothing(dyn):
    make, out = dyn
    monitor = _train(make(dynamic_on=False), 4, {})
    assert _collected_steps(out) == [] and monitor.loop.engine.calls == 0


def test_dynamic_on_from_the_start_then_switches_itself_off(dyn):
    make, out = dyn
    path = make(dynamic_on=True, collect_times=2, step_interval=1)
    _train(path, 5, {})
    assert _collected_steps(out) == [0, 1]
    saved = json.loads(open(path).read())
    assert saved["dynamic_on"] is False  # rewritten by the monitor ...
    assert saved["collect_times"] == 2 and saved["ops"] == ["norm"]  # ... keeping the user's other keys


def test_saving_the_on_config_again_after_it_switched_itself_off(dyn):
    """The switch-off after the last collection is in memory at once; the file is rewritten by rank 0.
    A save of the same "on" config before the monitor read its own rewrite compared equal to the mapping
    last applied (still "on"), and was ignored: off for the rest of the run, while the file said on."""
    make, out = dyn
    path = make(dynamic_on=True, collect_times=2, step_interval=1)
    on = open(path).read()

    def save_on_again(monitor: TrainerMon) -> None:
        with open(path, "w") as fh:  # the user's save: the same content as the config that was on
            fh.write(on)
        _wait_dirty(monitor)

    _train(path, 6, {2: save_on_again})
    assert _collected_steps(out) == [0, 1, 3, 4]


def test_an_edit_saved_during_the_last_collected_step_is_kept(dyn):
    """The monitor's own "dynamic_on": false after its last collection was written over an edit it had
    not applied yet (the file ended with dynamic_on false and the user's collect_times)."""
    make, out = dyn
    path = make(dynamic_on=True, collect_times=2, step_interval=1)
    _train(path, 7, {1: _edit(path, collect_times=3)})
    assert _collected_steps(out) == [0, 1, 2, 3, 4]


def test_switched_on_mid_run(dyn):
    make, out = dyn
    path = make(dynamic_on=False)
    _train(path, 7, {3: _edit(path, dynamic_on=True, collect_times=2)})
    assert _collected_steps(out) == [4, 5]


@pytest.mark.parametrize(("start_step", "interval", "expected"), [(0, 5, [4, 9]), (100, 3, [4, 7])])
def test_switched_on_mid_run_collects_from_that_step(dyn, start_step, interval, expected):
    """msprobe's rule: a config switched on collects from the step it applies at, every step_interval
    steps from there; the file's start_step is not used (it shifted the collections to 5, 10, and a large
    one left in the file delayed them past the end of the run)."""
    make, out = dyn
    path = make(dynamic_on=False)
    edit = _edit(path, dynamic_on=True, start_step=start_step, step_interval=interval, collect_times=2)
    _train(path, 12, {3: edit})
    assert _collected_steps(out) == expected


def test_on_from_the_start_collects_from_the_first_step(dyn):
    make, out = dyn
    _train(make(dynamic_on=True, start_step=5, step_interval=2, collect_times=2), 8, {})
    assert _collected_steps(out) == [0, 2]


def test_static_mode_keeps_start_step(tmp_path, static_mode, out_dir):
    """Without DYNAMIC_MONITOR a dynamic_on left in the config changes nothing: start_step holds."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**BASE, "dynamic_on": True, "start_step": 3, "step_interval": 2}))
    _train(str(path), 8, {})
    assert _collected_steps(str(tmp_path / "out")) == [3, 5, 7]


def test_edit_during_collection_applies_next_step_and_restarts_count(dyn):
    make, out = dyn
    path = make(dynamic_on=True, collect_times=5)
    monitor = _train(path, 8, {2: _edit(path, collect_times=2, ops=["norm", "max"])})
    assert _collected_steps(out) == [0, 1, 2, 3, 4]
    # The new ops went to a new output directory from step 3 on.
    new_dir_rows = [
        r
        for p in glob.glob(os.path.join(out, "*", "grad_reduced_*.csv"))
        for r in csv.DictReader(open(p))
        if "max" in r
    ]
    assert sorted({int(r["step"]) for r in new_dir_rows}) == [3, 4]
    assert monitor.config.dynamic_on is False  # the automatic stop was applied too


def test_an_edit_of_monitor_mbs_grad_writes_its_rows_under_their_own_header(dyn):
    """grad_unreduced gains a micro_step column: the rows after the edit go to a new run directory whose
    files have it in their header (not into the open file, under a header without it)."""
    make, out = dyn
    path = make(dynamic_on=True, step_count_per_record=4, ops=["norm"])
    _train(path, 4, {1: _edit(path, monitor_mbs_grad=True)})
    by_step: dict[int, set] = {}
    for p in glob.glob(os.path.join(out, "*", "grad_unreduced_*.csv")):
        for r in csv.DictReader(open(p)):
            assert float(r["norm"]) > 0 and r["shape"].startswith("["), (p, r)  # columns where they belong
            by_step.setdefault(int(r["step"]), set()).add(r.get("micro_step"))
    assert by_step == {0: {None}, 1: {None}, 2: {"0"}, 3: {"0"}}


def test_an_edit_of_the_gpu_hold_reaches_the_collector(dyn):
    make, _ = dyn
    path = make(dynamic_on=True, accelerator_hold_mib=64)
    seen = []

    def record(monitor: TrainerMon) -> None:
        seen.append(monitor.loop.collector.hold_bytes_accelerator)

    _train(path, 4, {1: lambda m: (record(m), _edit(path, accelerator_hold_mib=0)(m)), 3: record})
    assert seen == [64 << 20, 0]


def test_an_edit_of_a_key_read_at_start_is_said_and_the_running_value_kept(dyn, caplog):
    """queue_size and dynamic_watch are read when the worker and the watcher start: an edit of them was
    accepted, never applied, and `loop.config` showed the new values."""
    make, _ = dyn
    path = make(dynamic_on=True, queue_size=64, dynamic_watch="inotify")
    seen = []

    def record(monitor: TrainerMon) -> None:
        loop = monitor.loop
        seen.append((loop.config.queue_size, loop.config.dynamic_watch, loop.config.write_interval_s))

    edit = _edit(path, queue_size=2, dynamic_watch="polling", write_interval_s=0)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _train(path, 4, {1: edit, 3: record})
    assert seen == [(64, "inotify", 0)]  # the running values; write_interval_s does apply
    said = [r.getMessage() for r in caplog.records if "next start" in r.getMessage()]
    assert len(said) == 1, said
    assert "sets queue_size=2, dynamic_watch='polling', read at start only" in said[0], said
    assert "this run keeps queue_size=64, dynamic_watch='inotify'" in said[0], said
    # an edit between TrainerMon() and set_monitor: the watcher exists already, the worker not yet
    caplog.clear()
    path = make(dynamic_on=True, queue_size=64, dynamic_watch="inotify")
    early_keys = {"queue_size": 8, "dynamic_watch": "polling"}
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor = _train(path, 2, {}, before_attach=lambda m: update_config_file(path, **early_keys))
    assert (monitor.loop.config.queue_size, monitor.loop.config.dynamic_watch) == (8, "inotify")
    said = [r.getMessage() for r in caplog.records if "next start" in r.getMessage()]
    assert len(said) == 1 and "sets dynamic_watch='polling'" in said[0], said


def test_switched_on_again_after_automatic_stop(dyn):
    make, out = dyn
    path = make(dynamic_on=True, collect_times=2)
    _train(path, 8, {4: _edit(path, dynamic_on=True, collect_times=1)})
    assert _collected_steps(out) == [0, 1, 5]


def test_off_stops_at_the_next_step(dyn):
    make, out = dyn
    path = make(dynamic_on=True)
    _train(path, 6, {2: _edit(path, dynamic_on=False)})
    assert _collected_steps(out) == [0, 1, 2]


def test_collect_times_zero(dyn):
    make, out = dyn
    _train(make(dynamic_on=True, collect_times=0), 3, {})
    assert _collected_steps(out) == []


def test_bad_json_mid_run_keeps_config_and_warns_once(dyn, monkeypatch, caplog):
    """Invalid JSON is said once it stays invalid GONE_S (0 here: at the next step's poll; a save being
    written is not warned about); a valid file with a bad value at once."""
    monkeypatch.setattr("trainermon.runtime.control.GONE_S", 0.0)
    make, out = dyn
    path = make(dynamic_on=True)

    def half_written(monitor):
        with open(path, "w") as fh:
            fh.write('{"dynamic_on": tr')
        _wait_dirty(monitor)

    def wrong_type(monitor):
        with open(path, "w") as fh:
            json.dump({**BASE, "dynamic_on": True, "step_interval": "often"}, fh)
        _wait_dirty(monitor)

    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor = _train(
            path, 8, {2: half_written, 4: wrong_type, 5: _edit(path, dynamic_on=False, step_interval=1)}
        )
    assert _collected_steps(out) == [0, 1, 2, 3, 4, 5]
    warnings = [r.getMessage() for r in caplog.records if "keeping the current config" in r.getMessage()]
    assert len(warnings) == 2 and "not valid JSON" in warnings[0] and "step_interval" in warnings[1]
    assert monitor.faults.total == 0


def _delete(path: str) -> Callable[[TrainerMon], None]:
    def act(monitor: TrainerMon) -> None:
        os.remove(path)
        _wait_dirty(monitor)

    return act


def test_deleted_config_file_is_said_once_and_collection_goes_on(dyn, monkeypatch, caplog):
    """Deleted for good: one warning once it stayed away GONE_S (0 here), the running config kept."""
    monkeypatch.setattr("trainermon.runtime.control.GONE_S", 0.0)
    make, out = dyn
    path = make(dynamic_on=True)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _train(path, 6, {2: _delete(path)})
    said = [r.getMessage() for r in caplog.records if "was deleted" in r.getMessage()]
    assert len(said) == 1 and "dynamic_on=true" in said[0], said
    assert _collected_steps(out) == [0, 1, 2, 3, 4, 5]


def test_config_file_deleted_and_written_again_is_no_news(dyn, monkeypatch, caplog):
    """An editor's delete-and-write: the new content applies and nothing is said about a deletion."""
    monkeypatch.setattr("trainermon.runtime.control.GONE_S", 0.0)
    make, out = dyn
    path = make(dynamic_on=False)

    def rewrite(monitor: TrainerMon) -> None:
        os.remove(path)
        with open(path, "w") as fh:
            json.dump({**BASE, "dynamic_on": True, "collect_times": 2}, fh)
        _wait_dirty(monitor)

    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _train(path, 6, {2: rewrite})
    assert not [r for r in caplog.records if "deleted" in r.getMessage()]
    assert _collected_steps(out) == [3, 4]


def test_an_edit_with_an_unknown_key_is_warned_once(dyn, caplog):
    make, out = dyn
    path = make(dynamic_on=False)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _train(path, 4, {1: _edit(path, dynamic_on=True, colect_times=3)})
    said = [r.getMessage() for r in caplog.records if "'colect_times'" in r.getMessage()]
    assert len(said) == 1, said
    assert _collected_steps(out) == [2, 3]


def test_an_edit_before_set_monitor_applies_at_the_first_step(dyn):
    """`trainermon on` between `TrainerMon()` (which read the file) and `set_monitor` (which starts the
    watcher): the first step reads the file again (the edit was never applied: 0 rows)."""
    make, out = dyn
    path = make(dynamic_on=False)
    _train(path, 4, {}, before_attach=lambda _m: update_config_file(path, dynamic_on=True, collect_times=2))
    assert _collected_steps(out) == [0, 1]


@pytest.mark.parametrize("saved_on", [True, False], ids=["saved-on", "saved-off"])
def test_after_a_resume_the_file_decides(dyn, saved_on):
    """A job resumed from a checkpoint whose monitor state says `dynamic_on` one way while the file, edited
    while the job was down, says the other: the file holds (the state's value overrode it, and a later
    `trainermon off` that wrote the same content as the file read at start was never seen)."""
    make, out = dyn
    path = make(dynamic_on=not saved_on, collect_times=100)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, optimizer=opt)
    state = {**monitor.state_dict(), "step": 5, "dynamic_on": saved_on, "schedule_collected": 1}
    monitor.load_state_dict(state)
    for step in range(5, 9):
        if step == 7 and not saved_on:  # collecting since the resume: `trainermon off` stops it
            _edit(path, dynamic_on=False)(monitor)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert _collected_steps(out) == ([] if saved_on else [5, 6, 7])
