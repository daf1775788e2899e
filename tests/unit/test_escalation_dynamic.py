"""`dynamic_on: false` stops escalation too (an anomaly audit): every module's activations went on being
collected for the rest of an escalation, and anomaly records raised, after the file switched collection
off. An escalation that follows the last of `collect_times` (the monitor switching itself off) stays."""

from __future__ import annotations

import json

from tests.unit.dynamic_common import BASE, _collected_steps, _train, _wait_dirty
from trainermon import TrainerMon
from trainermon.runtime.control import update_config_file

ESCALATE = 5


def _config(tmp_path, **keys) -> str:
    path = tmp_path / "monitor_config.json"
    alert = {"rules": [{"rule_name": "AnomalyNan"}], "escalate_steps": ESCALATE}
    path.write_text(json.dumps({**BASE, "dynamic_on": True, "alert": alert, **keys}))
    return str(path)


def _escalate(monitor: TrainerMon) -> None:
    monitor.loop.escalation.request(ESCALATE)  # what the worker does for an anomaly


def test_switching_off_ends_an_escalation(tmp_path, out_dir, dynamic_mode):
    path = _config(tmp_path)

    def switch_off(monitor: TrainerMon) -> None:
        update_config_file(path, dynamic_on=False)
        _wait_dirty(monitor)

    # requested before step 2: escalated from step 3; switched off before step 4: off from step 5
    _train(path, 9, {2: _escalate, 4: switch_off})
    assert _collected_steps(str(out_dir), "actv") == [3, 4]
    assert _collected_steps(str(out_dir)) == [0, 1, 2, 3, 4]


def test_an_escalation_after_the_last_collection_runs_its_course(tmp_path, out_dir, dynamic_mode):
    path = _config(tmp_path, collect_times=3)
    _train(path, 9, {2: _escalate})  # steps 0-2 collected; the monitor switches itself off after step 2
    assert _collected_steps(str(out_dir)) == [0, 1, 2]
    assert _collected_steps(str(out_dir), "actv") == list(range(3, 3 + ESCALATE))
