"""Dynamic mode's config watcher (every save style and backend) and `trainermon on/off`."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.unit.dynamic_common import BASE
from trainermon import parse_config
from trainermon.cli import main as cli_main
from trainermon.runtime.control import ConfigWatcher, DynamicControl, update_config_file


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
