"""Dynamic mode: edits that were lost or misread. A save landing while the monitor writes the file (the
automatic stop after collect_times, the CLI's on/off), a relative config path after os.chdir, a save read
half-written, and a reload that fails on one rank only.

Reference for the collected steps (step_interval 1, as README says): an edit made before step i applies
from step i + 1; a save made during the last collection of step k applies from step k + 1; a config
collects `collect_times` consecutive steps from the step it applies at."""

from __future__ import annotations

import json
import logging
import os
import time

from tests.distributed import run_ranks
from tests.unit.dynamic_common import BASE, _collected_steps, _train, _wait_dirty
from trainermon.runtime import control
from trainermon.runtime.control import update_config_file


def _save(path: str, config: dict) -> None:
    """The user's atomic save (an editor's or `trainermon on`'s): a new file renamed over the old."""
    with open(path + ".user", "w") as fh:
        json.dump(config, fh)
    os.replace(path + ".user", path)


def _save_during_monitor_write(monkeypatch, path: str, config: dict, monitor=None) -> list:
    """The user saves `config` while the monitor writes the file (inside its fsync: the slow part, ms on
    a local disk, far more on NFS), once; with `monitor`, until its watcher has seen the save."""
    real, saved = os.fsync, []

    def fsync(fd: int) -> None:
        real(fd)
        if not saved and ".trainermon-" in os.readlink(f"/proc/self/fd/{fd}"):
            saved.append(True)
            _save(path, config)
            if monitor is not None:
                _wait_dirty(monitor)

    monkeypatch.setattr(os, "fsync", fsync)
    return saved


def _read(path) -> dict:
    with open(path) as fh:
        return json.load(fh)


def test_auto_stop_keeps_a_save_made_while_it_writes(tmp_path, out_dir, dynamic_mode, monkeypatch):
    """The stop after collect_times read the file, then wrote it back with dynamic_on false: a save landing
    meanwhile was replaced by the old config (never applied, gone from the file)."""
    path = str(tmp_path / "cfg.json")
    _save(path, BASE)
    a = {**BASE, "dynamic_on": True, "collect_times": 2}
    b = {**BASE, "dynamic_on": True, "collect_times": 3, "ops": ["norm", "max"]}
    saved: list = []

    def save_a(monitor):
        _save(path, a)
        _wait_dirty(monitor)
        saved.append(_save_during_monitor_write(monkeypatch, path, b, monitor))

    edit_before, steps = 2, 10
    _train(path, steps, {edit_before: save_a})
    first_a = edit_before + 1
    first_b = first_a + a["collect_times"]  # saved during A's last collection
    expected = list(range(first_a, first_a + a["collect_times"])) + list(
        range(first_b, first_b + b["collect_times"])
    )
    assert saved[0], "the monitor never wrote the file"
    assert _collected_steps(str(out_dir)) == expected
    assert _read(path) == {**b, "dynamic_on": False}  # B's own stop after its collect_times


def test_cli_update_merges_into_a_save_made_while_it_writes(tmp_path, monkeypatch):
    """`trainermon on`/`off` (update_config_file): the save made meanwhile was replaced by the old file."""
    path = str(tmp_path / "cfg.json")
    a, b = {**BASE, "collect_times": 2}, {**BASE, "collect_times": 7, "ops": ["max"]}
    _save(path, a)
    saved = _save_during_monitor_write(monkeypatch, path, b)
    new = update_config_file(path, dynamic_on=True)
    assert saved
    assert new == _read(path) == {**b, "dynamic_on": True}


def test_relative_config_path_survives_chdir(tmp_path, out_dir, dynamic_mode, monkeypatch, caplog):
    """The path was kept relative and opened against the current directory at each reload: after an
    os.chdir every edit was ignored, with a false warning that the file was deleted."""
    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    job.mkdir()
    elsewhere.mkdir()
    _save(str(job / "cfg.json"), BASE)
    monkeypatch.chdir(job)

    def move_and_edit(monitor):
        os.chdir(elsewhere)  # (monkeypatch restores the directory)
        _save(str(job / "cfg.json"), {**BASE, "dynamic_on": True})
        _wait_dirty(monitor)

    edit_before, steps = 2, 8
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _train("cfg.json", steps, {edit_before: move_and_edit})
    assert _collected_steps(str(out_dir)) == list(range(edit_before + 1, steps))
    assert not [r for r in caplog.records if "deleted" in r.getMessage()]


def test_half_written_save_is_not_warned_a_lasting_one_once(
    tmp_path, out_dir, dynamic_mode, monkeypatch, caplog
):
    """A save read half-written logged a WARNING although it completed ms later; a file that stays
    invalid is still said, once."""
    monkeypatch.setattr(control, "GONE_S", 0.3)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(BASE))
    text = json.dumps({**BASE, "dynamic_on": True})
    held: list = []

    def half(monitor):  # an in-place save, its first half on disk (read at this step's end)
        fh = open(path, "w")  # noqa: SIM115 - completed by `rest`
        fh.write(text[: len(text) // 2])
        fh.flush()
        held.append(fh)
        _wait_dirty(monitor)

    def rest(monitor):
        held[0].write(text[len(text) // 2 :])
        held[0].close()
        _wait_dirty(monitor)

    def broken(monitor):
        path.write_text("{not json")
        _wait_dirty(monitor)

    def later(monitor):
        time.sleep(0.4)  # > GONE_S

    def invalid_said() -> list:
        return [r for r in caplog.records if r.levelno >= logging.WARNING and "is invalid" in r.getMessage()]

    counts: list = []
    actions = {2: half, 3: rest, 5: lambda m: counts.append(len(invalid_said())), 6: broken, 7: later}
    with caplog.at_level(logging.DEBUG, logger="trainermon"):
        _train(str(path), 12, actions)
    assert counts == [0]  # the half-written read: DEBUG only
    assert len(invalid_said()) == 1 and "not valid JSON" in invalid_said()[0].getMessage()
    # the completed save applied (from step 4); the invalid file kept it running
    assert _collected_steps(str(out_dir)) == list(range(4, 12))


# ---- a reload that fails on one rank -------------------------------------------------------------------
def _reload_fails_on_rank_1(rank: int, world: int, root: str) -> tuple[list[int], bool]:
    os.environ["DYNAMIC_MONITOR"] = "true"
    out = os.path.join(root, f"out{rank}")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    path = os.path.join(root, f"cfg{rank}.json")  # only rank 0's is read
    _save(path, BASE)
    failed: list = []

    def subscriber(config):  # a probe's config update that raises on rank 1, once
        if rank == 1 and config.dynamic_on and not failed:
            failed.append(True)
            raise RuntimeError("probe update failed")

    def hook(monitor):
        monitor.loop._subscribers.insert(0, subscriber)

    def save_on(monitor):
        if rank == 0:
            _save(path, {**BASE, "dynamic_on": True})
            _wait_dirty(monitor)

    monitor = _train(path, 9, {2: save_on, 5: save_on}, before_attach=hook)
    return _collected_steps(out), monitor.loop.config.dynamic_on


def test_a_reload_failing_on_one_rank_leaves_every_rank_on_the_same_config(tmp_path):
    """The failing rank went on with a half-applied config (and an empty plan at that step) while the
    others collected: different steps, or a hang in the cross-rank collectives. Now every rank keeps the
    previous config (off), and saving the file again applies it on every rank."""
    results = run_ranks(_reload_fails_on_rank_1, world_size=2, timeout=120, root=str(tmp_path))
    expected = list(range(5 + 1, 9))  # the failed save applies nowhere; the second, before step 5, from 6
    assert results == [(expected, True), (expected, True)]
