"""Targets that select parameters by a prefix ending inside a dotted part (`layers.1` selecting
`layers.10.*`) keep msprobe's selection and say so once, in every form the target selects by."""

from __future__ import annotations

import logging

import torch
from torch import nn

from tests.helpers import write_config
from tests.unit.test_targets import _train_sequential, _warnings


def test_prefix_cutting_a_name_warns(tmp_path, out_dir, static_mode, caplog):
    """Prefixes stay plain string prefixes (msprobe's): "1" selects layers 1 and 10, and says so once,
    naming the fix; "1." selects layer 1 alone, silently."""
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        names = _train_sequential(tmp_path / "a", 11, {"1": {}})
    assert names == {"1.weight", "1.bias", "10.weight", "10.bias"}
    lines = _warnings(caplog)
    assert len(lines) == 1 and "'1' selects parameters by name prefix" in lines[0], lines
    assert "'10." in lines[0] and "'1.'" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        assert _train_sequential(tmp_path / "b", 11, {"1.": {}}) == {"1.weight", "1.bias"}
    assert not _warnings(caplog)


def test_prefix_cutting_a_name_warns_in_every_form_it_selects_by(tmp_path, out_dir, static_mode, caplog):
    """The warning checks the forms the target selects by: HF's `model.layers.10.*` through its
    `layers.` segment, and stage 0's `10.*` through the `vpp:` form of a target with a colon."""
    from trainermon import TrainerMon

    class Hf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(11)])

    model = Hf()
    monitor = TrainerMon(write_config(tmp_path / "c.json", targets={"layers.1": {}}, wg_distribution=True))
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    monitor.close()
    lines = _warnings(caplog)
    assert len(lines) == 1 and "'layers.1' selects parameters by name prefix" in lines[0], lines
    assert "'model.layers.10.weight'" in lines[0] and "'layers.1.'" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        names = _train_sequential(tmp_path / "a", 11, {"0:1": {}})
    assert names == {"1.weight", "1.bias", "10.weight", "10.bias"}
    lines = _warnings(caplog)
    assert len(lines) == 1 and "'0:1' selects parameters by name prefix" in lines[0], lines
    assert "'10.weight'" in lines[0] and "'0:1.'" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainermon"):  # all of stage 0: no name is cut
        assert len(_train_sequential(tmp_path / "b", 11, {"0:": {}})) == 22
    assert not _warnings(caplog)
