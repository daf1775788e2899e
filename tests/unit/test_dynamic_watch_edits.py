"""Dynamic mode: edits the watcher used to miss. A k8s ConfigMap's symlink swap (both watch modes), an
in-place edit through a symlink into another folder, and (polling) a same-size edit whose mtime is put
back, as on a coarse-mtime filesystem (NFS)."""

from __future__ import annotations

import json
import os

import pytest

from tests.unit.dynamic_common import BASE, _collected_steps, _train, _wait_dirty


def _publish(cm: str, name: str, config: dict) -> None:
    """What kubelet's AtomicWriter does: a new `..vN` folder, `..data_tmp` -> it, renamed over `..data`."""
    os.makedirs(os.path.join(cm, name))
    with open(os.path.join(cm, name, "cfg.json"), "w") as fh:
        json.dump(config, fh)
    os.symlink(name, os.path.join(cm, "..data_tmp"))
    os.replace(os.path.join(cm, "..data_tmp"), os.path.join(cm, "..data"))


@pytest.mark.parametrize("watch", ["inotify", "polling"])
def test_configmap_symlink_swap_is_followed(tmp_path, out_dir, dynamic_mode, watch):
    cm = str(tmp_path / "cm")
    os.makedirs(cm)
    first = {**BASE, "dynamic_watch": watch}
    _publish(cm, "..2026_01", first)
    path = os.path.join(cm, "cfg.json")
    os.symlink("..data/cfg.json", path)
    on = {**first, "dynamic_on": True}

    def swap(monitor):
        _publish(cm, "..2026_02", on)
        _wait_dirty(monitor)

    edit_before, steps = 2, 8
    monitor = _train(path, steps, {edit_before: swap})
    # Reference: an edit made before step i applies from step i + 1, every step (step_interval 1).
    assert _collected_steps(str(out_dir)) == list(range(edit_before + 1, steps))
    with open(os.path.join(cm, "..2026_02", "cfg.json")) as fh:
        assert monitor.loop.control._raw == json.load(fh)


def test_in_place_edit_through_symlink_into_another_folder(tmp_path, out_dir, dynamic_mode):
    real = tmp_path / "real"
    real.mkdir()
    target = real / "cfg.json"
    target.write_text(json.dumps(BASE))
    link_dir = tmp_path / "job"
    link_dir.mkdir()
    path = link_dir / "cfg.json"
    os.symlink(str(target), str(path))

    def edit(monitor):
        with open(target, "w") as fh:  # in place, in the target's folder: no event in the link's folder
            json.dump({**BASE, "dynamic_on": True}, fh)
        _wait_dirty(monitor)

    _train(str(path), 7, {3: edit})
    assert _collected_steps(str(out_dir)) == [4, 5, 6]


def test_polling_sees_same_size_edit_with_unchanged_mtime(tmp_path, out_dir, dynamic_mode):
    path = str(tmp_path / "cfg.json")
    keys = {**BASE, "dynamic_watch": "polling", "collect_times": 10, "step_interval": 1}

    def write(**changes) -> None:
        with open(path, "w") as fh:
            json.dump({**keys, **changes}, fh)

    write(dynamic_on=False)

    def switch_on(monitor):
        write(dynamic_on=True)
        _wait_dirty(monitor)

    def same_stat_edit(monitor):
        before = os.stat(path)
        write(dynamic_on=True, collect_times=20, step_interval=2)  # 10 -> 20, 1 -> 2: the same size
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(path)
        assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        _wait_dirty(monitor)

    _train(path, 10, {2: switch_on, 5: same_stat_edit})
    # Reference: every step from 3 (on before step 2); step_interval 2 from the config applied at step 6.
    expected = [3, 4, 5] + list(range(6, 10, 2))
    assert _collected_steps(str(out_dir)) == expected
