"""print_struct and stack_info on models users have: a scripted submodule (takes no Python hooks), a
module that once had an old-style backward hook (torch then refuses full ones), and a first collected
step after uncollected ones (the struct must still hold that step's inputs and outputs)."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch
from torch import nn

from tests.helpers import write_config
from trainermon import TrainerMon
from trainermon.runtime.probes.side_outputs import PrintStructDone


def _struct(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "module_struct" / "rank0" / "module_struct.json").read_text())


def test_a_scripted_submodule_and_an_old_backward_hook_leave_the_rest_described(tmp_path, out_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), torch.jit.script(nn.Sequential(nn.Tanh())), nn.Linear(4, 1))
    model[2].register_backward_hook(lambda *a: None).remove()  # the flag outlives the hook
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", print_struct=True, stack_info=True))
    monitor.set_monitor(model, optimizer=opt)  # raised for either module
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(PrintStructDone):
        opt.step()
    monitor.close()
    struct = _struct(tmp_path)
    assert list(struct) == ["0:0", "0:2", "0:"], list(struct)
    assert struct["0:0"]["output"] == {"config": "tensor", "tensor": "size=(2, 4), dtype=torch.float32"}
    assert "input_grad" in struct["0:0"] and "input_grad" not in struct["0:2"]  # msprobe leaves it out too
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    with open(os.path.join(monitor.run_dir, "stack_info.csv"), newline="") as fh:
        assert [r["module_name"] for r in csv.DictReader(fh)] == ["0:0", "0:2", "0:"]
    # close() put the module's old-style flag back: the user's own old-style hook works again
    model[0].register_backward_hook(lambda *a: None).remove()


def test_the_first_collected_step_after_uncollected_ones_is_described(tmp_path, out_dir):
    """start_step 1: step 0's backward once left empty entries that blocked step 1's forward rows."""
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", print_struct=True, start_step=1))
    monitor.set_monitor(model, optimizer=opt)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(PrintStructDone):
        opt.step()
    monitor.close()
    struct = _struct(tmp_path)
    assert list(struct) == ["0:0", "0:1", "0:"], list(struct)
    assert list(struct["0:0"]) == ["input", "output", "input_grad", "output_grad", "class"]
