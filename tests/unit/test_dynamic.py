"""Dynamic start/stop (DYNAMIC_MONITOR=true): the user guide's scenarios, save styles, two ranks agreeing.

Edits are made "before step i" (before its forward); the watcher flags them within milliseconds and the
new config applies at the next step boundary, i.e. from step i + 1 on.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import sys
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from trainermon import TrainerMon, parse_config
from trainermon.cli import main as cli_main
from trainermon.runtime.control import ConfigWatcher, DynamicControl, update_config_file

BASE = {"wg_distribution": True, "ops": ["norm"], "dynamic_on": False, "collect_times": 100}


def _collected_steps(out_root: str, family: str = "grad_reduced") -> list[int]:
    steps: set[int] = set()
    for path in glob.glob(os.path.join(out_root, "*", f"{family}_*.csv")):
        with open(path, newline="") as fh:
            steps |= {int(r["step"]) for r in csv.DictReader(fh)}
    return sorted(steps)


def _wait_dirty(monitor: TrainerMon, timeout: float = 30.0) -> None:
    watcher = monitor.loop.control.watcher
    deadline = time.monotonic() + timeout
    while not watcher.dirty and time.monotonic() < deadline:
        time.sleep(0.005)
    assert watcher.dirty, "the watcher did not see the save"


def _train(
    cfg_path: str,
    steps: int,
    actions: dict[int, Callable[[TrainerMon], None]],
    process_group=None,
    before_attach: Callable[[TrainerMon], None] | None = None,
) -> TrainerMon:
    """`steps` steps of a tiny model; `actions[i]` runs before step i, `before_attach` between
    `TrainerMon()` and `set_monitor`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg_path, process_group=process_group)
    if before_attach is not None:
        before_attach(monitor)
    monitor.set_monitor(model, optimizer=opt)
    for i in range(steps):
        if i in actions:
            actions[i](monitor)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor


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


def test_bad_json_mid_run_keeps_config_and_warns_once(dyn, caplog):
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
            path, 8, {2: half_written, 3: wrong_type, 5: _edit(path, dynamic_on=False, step_interval=1)}
        )
    assert _collected_steps(out) == [0, 1, 2, 3, 4, 5]
    warnings = [r.getMessage() for r in caplog.records if "keeping the current config" in r.getMessage()]
    assert len(warnings) == 2 and "not valid JSON" in warnings[0] and "step_interval" in warnings[1]
    assert monitor.faults.total == 0


# ---- save styles ---------------------------------------------------------------------------------
def _in_place(path):
    with open(path, "w") as fh:
        fh.write('{"a": 1}')


def _atomic_replace(path):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write('{"a": 2}')
    os.replace(tmp, path)


def _rename_and_create(path):
    os.rename(path, path + "~")  # editors that keep a backup
    with open(path, "w") as fh:
        fh.write('{"a": 3}')


def _delete_and_recreate(path):
    os.unlink(path)
    time.sleep(0.05)
    with open(path, "w") as fh:
        fh.write('{"a": 4}')


@pytest.mark.parametrize("save", [_in_place, _atomic_replace, _rename_and_create, _delete_and_recreate])
@pytest.mark.parametrize("backend", ["inotify", "polling", "stat"])
def test_every_save_style_is_seen(tmp_path, monkeypatch, save, backend):
    path = str(tmp_path / "cfg.json")
    with open(path, "w") as fh:
        fh.write("{}")
    time.sleep(0.02)
    if backend == "stat":
        monkeypatch.setitem(sys.modules, "watchdog.observers", None)  # as if watchdog were not installed
    watcher = ConfigWatcher(path, polling=backend == "polling", poll_interval=0.1)
    try:
        assert (
            watcher.backend
            == {"inotify": "watchdog", "polling": "watchdog-polling", "stat": "stat-polling"}[backend]
        )
        time.sleep(0.15)
        watcher.dirty = False
        time.sleep(0.01)
        save(path)
        deadline = time.monotonic() + 30
        while not watcher.dirty and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.dirty
    finally:
        watcher.stop()


@pytest.mark.parametrize("backend", ["inotify", "polling", "stat"])
def test_a_save_before_the_watcher_thread_runs_is_seen(tmp_path, monkeypatch, backend):
    """A save made once the watcher exists but before its thread first runs (a loaded host) is seen:
    every back-end takes its baseline (or sets its watch) before the constructor returns. The watcher's
    loop is held back 0.5 s here, so a baseline taken on that thread would be the saved file."""
    import threading

    from watchdog.observers.api import EventEmitter

    path = str(tmp_path / "cfg.json")
    with open(path, "w") as fh:
        fh.write("{}")
    if backend == "stat":
        monkeypatch.setitem(sys.modules, "watchdog.observers", None)
    owner = threading.Thread if backend == "stat" else EventEmitter  # whose run() the watcher loops in
    late_run = owner.run

    def held_back(self) -> None:
        time.sleep(0.5)
        late_run(self)

    monkeypatch.setattr(owner, "run", held_back)
    watcher = ConfigWatcher(path, polling=backend == "polling", poll_interval=0.1)
    try:
        with open(path, "w") as fh:
            fh.write('{"collect_times": 3}')
        deadline = time.monotonic() + 30
        while not watcher.dirty and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.dirty, watcher.backend
    finally:
        watcher.stop()


def test_burst_of_saves_is_one_reload(tmp_path):
    from trainermon.config import parse_config

    path = str(tmp_path / "cfg.json")
    with open(path, "w") as fh:
        json.dump(BASE, fh)
    control = DynamicControl(path, parse_config(BASE))
    control.attach()
    try:
        for i in range(20):
            update_config_file(path, collect_times=i + 1)
        time.sleep(0.3)
        new = control.poll()
        assert new is not None and new.collect_times == 20 and control.version == 1
        assert control.poll() is None
    finally:
        control.close()


# ---- CLI -----------------------------------------------------------------------------------------
def test_cli_on_and_off(tmp_path, capsys):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**BASE, "targets": {"layers.0": {}}, "mv_distribution": True}))
    assert cli_main(["on", str(path), "--collect-times", "7", "--families", "grad_reduced,actv"]) == 0
    saved = json.loads(path.read_text())
    assert saved["dynamic_on"] is True and saved["collect_times"] == 7
    assert saved["wg_distribution"] and saved["xy_distribution"] and saved["forward_only"]
    assert saved["mv_distribution"] is False and saved["targets"] == {"layers.0": {}}
    assert cli_main(["off", str(path)]) == 0
    assert json.loads(path.read_text())["dynamic_on"] is False
    # `off` on a file a running job would ignore (invalid) is no success: the job would go on collecting
    path.write_text(json.dumps({**BASE, "dynamic_on": True, "ops": "norm"}))
    assert cli_main(["off", str(path)]) == 2
    assert "a running job ignores it" in capsys.readouterr().err
    path.write_text(json.dumps({**BASE, "targets": {"layers.0": {}}, "mv_distribution": True}))
    assert cli_main(["on", str(path), "--families", "gradients"]) == 2
    assert cli_main(["on", str(path), "--collect-times", "-1"]) == 2  # refused: would be an invalid config
    assert json.loads(path.read_text())["dynamic_on"] is False
    assert "collect_times" in capsys.readouterr().err


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


def test_cli_on_families_replace_the_previous_choice(tmp_path):
    """Each `on --families` sets both forward_only and backward_only: actv, then actv_grad, is accepted
    (the first call's forward_only once made the second an invalid config), and xy takes both."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**BASE, "all_xy": True}))  # every module's activations, by itself
    expected = {"actv": (True, False), "actv_grad": (False, True), "grad_reduced": (False, False)}
    expected |= {"actv,actv_grad": (False, False), "xy": (False, False), "xy,actv": (False, False)}
    for families, (forward, backward) in [*expected.items(), ("actv", (True, False))]:
        assert cli_main(["on", str(path), "--families", families]) == 0, families
        saved = json.loads(path.read_text())
        assert (saved["forward_only"], saved["backward_only"]) == (forward, backward), families
        assert saved["xy_distribution"] is (families != "grad_reduced"), families
        assert saved["all_xy"] is False, families  # `on --families grad_reduced` must not keep activations


def test_cli_on_turns_on_the_health_families(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(BASE))
    assert cli_main(["on", str(path), "--families", "update,moe_load,attn_logit"]) == 0
    saved = json.loads(path.read_text())
    on = [
        k for k in ("update_distribution", "moe_distribution", "attn_logit_distribution") if saved[k] is True
    ]
    assert len(on) == 3 and saved["wg_distribution"] is False and saved["dynamic_on"] is True, saved
    parse_config(saved)  # a valid config


def test_cli_on_changes_only_a_sections_enable(tmp_path):
    """`cc_distribution` and `attn_logit_distribution` are sections: `on --families` flips their `enable`
    and keeps the rest (`sample`, `cc_log_only`), and `comm` is a family like the others."""
    path = tmp_path / "cfg.json"
    sections = {
        "attn_logit_distribution": {"enable": True, "sample": 64},
        "cc_distribution": {"enable": True, "cc_log_only": True},
    }
    path.write_text(json.dumps({**BASE, **sections}))
    assert cli_main(["on", str(path), "--families", "wg"]) == 0
    saved = json.loads(path.read_text())
    assert saved["attn_logit_distribution"] == {"enable": False, "sample": 64}, saved
    assert saved["cc_distribution"] == {"enable": False, "cc_log_only": True}, saved
    assert cli_main(["on", str(path), "--families", "comm,attn_logit"]) == 0
    config = parse_config(json.loads(path.read_text()))
    assert config.cc_distribution.enable and config.cc_distribution.cc_log_only
    assert config.attn_logit_distribution.enable and config.attn_logit_distribution.sample == 64
    assert not config.wg_distribution


# ---- two ranks -----------------------------------------------------------------------------------
def _two_rank_switch(rank: int, world: int, root: str, own_group: bool) -> list[int]:
    # Each rank reads its own copy of the config: a filesystem on which rank 1 sees edits 3 steps late.
    # own_group: each rank passes a group of itself alone as process_group (msprobe's Megatron insertion
    # passes the pipeline group: one rank with PP=1); the decision is still the job's.
    import torch.distributed as dist

    group = dist.new_subgroups(group_size=1)[0] if own_group else None
    os.environ["DYNAMIC_MONITOR"] = "true"
    out = os.path.join(root, f"out{rank}")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    path = os.path.join(root, f"cfg{rank}.json")
    with open(path, "w") as fh:
        json.dump(BASE, fh)
    lag = 0 if rank == 0 else 3

    def edit(**changes):
        def act(monitor):
            update_config_file(path, **changes)
            if monitor.loop.control.watcher is not None:
                _wait_dirty(monitor)

        return act

    _train(path, 12, {2 + lag: edit(dynamic_on=True), 6 + lag: edit(dynamic_on=False)}, group)
    return _collected_steps(out)


@pytest.mark.parametrize("own_group", [False, True], ids=["default-group", "process_group-of-one"])
def test_two_ranks_switch_on_the_same_step(tmp_path, own_group):
    """With a process_group of one rank each, each rank once decided alone: rank 1 switched 3 steps
    late here, and with xrank summaries on the first rank to switch waited in their collective forever."""
    steps = run_ranks(_two_rank_switch, world_size=2, timeout=120, root=str(tmp_path), own_group=own_group)
    assert steps[0] == steps[1] == [3, 4, 5, 6]


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


def _starting_apart(rank: int, world_size: int, root: str, resumed: bool) -> list[int]:
    # Each rank reads its own file, and they disagree when the ranks start (a `trainermon on` landing
    # between two ranks' start): rank 0 says on, rank 1 off. Resumed: a checkpoint's monitor state (on,
    # one of the three collections done) loaded before set_monitor.
    os.environ["DYNAMIC_MONITOR"] = "true"
    out = os.path.join(root, f"out{rank}")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    path = os.path.join(root, f"cfg{rank}.json")
    with open(path, "w") as fh:
        json.dump({**BASE, "dynamic_on": rank == 0, "collect_times": 3, "dynamic_watch": "polling"}, fh)

    def resume(monitor: TrainerMon) -> None:
        if resumed:
            state = monitor.state_dict()
            monitor.load_state_dict({**state, "step": 5, "dynamic_on": True, "schedule_collected": 1})

    _train(path, 5, {}, before_attach=resume)
    return _collected_steps(out)


@pytest.mark.parametrize("resumed", [False, True], ids=["started", "resumed"])
def test_ranks_that_start_with_different_files_follow_rank_0(resumed):
    """Each rank kept the config it read at start: rank 0 collected and waited in the cross-rank
    summaries' collective, which rank 1 never ran (the job hung). Rank 0's config reaches every rank at
    the first step, before a restored state: rank 1 adopting rank 0's config after the restore started
    its collect_times count over, and the ranks parted at step 7 (a hang again)."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        steps = run_ranks(_starting_apart, world_size=2, timeout=120, root=root, resumed=resumed)
    assert steps[0] == steps[1] == ([5, 6] if resumed else [0, 1, 2])
