"""`print_struct` stops the run after its first collected step: the message is said once (before: logged,
then printed again by the interpreter from `SystemExit`'s code), and the rank directory holds no rows of
that step (before: grad_reduced, grad_unreduced, param_* and exp_avg* rows of step 0, no actv rows: a
partial step; msprobe writes none either)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.helpers import write_config
from trainermon import PrintStructDone, TrainerMon

#: every family that writes rows, so that any row file of the stopped step would show
FAMILIES = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": ["norm", "max"],
    "format": "csv",
}

SCRIPT = """
import torch
from torch import nn
from trainermon import TrainerMon
model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
monitor = TrainerMon({config!r})
monitor.set_monitor(model, optimizer=opt, grad_acc_steps=2)
for step in range(3):
    for micro in range(2):
        model(torch.ones(2, 3)).square().sum().backward()
    opt.step()
    opt.zero_grad()
raise AssertionError("print_struct did not stop the run")
"""


def _files(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def test_print_struct_stops_once_said_without_rows(tmp_path, out_dir, static_mode, caplog):
    cfg = write_config(tmp_path / "cfg.json", print_struct=True, **FAMILIES)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt, grad_acc_steps=2)
    for _ in range(2):
        model(torch.ones(2, 3)).square().sum().backward()
    with caplog.at_level(logging.INFO, logger="trainermon"):
        with pytest.raises(PrintStructDone) as raised:
            opt.step()
    run_dir = os.path.relpath(monitor.run_dir, out_dir)
    # The rank directory: its layout (written when the sinks open, at set_monitor), no rows
    assert _files(out_dir) == {"module_struct/rank0/module_struct.json", f"{run_dir}/layout.json"}
    path = out_dir / "module_struct" / "rank0" / "module_struct.json"
    assert list(json.loads(path.read_text())) == ["0:0", "0:1", "0:2", "0:"]
    said = [r for r in caplog.records if "print_struct is on" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0].getMessage()
    assert str(raised.value) == said[0].getMessage() and raised.value.code == 1  # an int: not printed again
    assert monitor.faults.total == 0, dict(monitor.faults.counts)


def test_print_struct_run_says_it_once_and_exits_1(tmp_path):
    """As a script: exit status 1, the message once on stderr (no logging configured: Python's last-resort
    handler shows the warning; the interpreter printed SystemExit's message a second time)."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.json", print_struct=True, **FAMILIES)
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(out)}
    env.pop("DYNAMIC_MONITOR", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(config=cfg)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("print_struct is on: module structure written to") == 1, proc.stderr[-3000:]
    assert not [f for f in _files(out) if f.endswith(".csv")]


def test_print_struct_raises_no_torch_warning_in_backward(tmp_path, out_dir, static_mode):
    """The first layer's input needs no gradient: torch warned about the monitor's full backward hook
    there, and under warnings-as-errors (`-W error`, set before the monitor) that warning was raised
    inside the user's backward()."""
    import warnings

    cfg = write_config(tmp_path / "cfg.json", print_struct=True, xy_distribution=True)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():  # restores the process's filters afterwards
        warnings.simplefilter("error")
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, optimizer=opt)
        model(torch.ones(2, 3)).square().sum().backward()  # raised UserWarning here
        with pytest.raises(PrintStructDone):
            opt.step()
    assert "0:0" in json.loads((out_dir / "module_struct" / "rank0" / "module_struct.json").read_text())


def test_print_struct_filter_goes_at_close(tmp_path, out_dir, static_mode):
    """The filter is the monitor's while its hooks are on: after close() the user's own full backward
    hooks warn again (a process-wide filter left behind hid them for the rest of the process)."""
    import warnings

    def ours() -> list:
        return [f for f in warnings.filters if "Full backward hook is firing" in getattr(f[1], "pattern", "")]

    cfg = write_config(tmp_path / "cfg.json", print_struct=True, xy_distribution=True)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    assert len(ours()) == 1
    monitor.close()
    assert ours() == []
    # the user's own identical filter, set before: kept at close()
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are")
    try:
        second = TrainerMon(cfg)
        second.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
        second.close()
        assert len(ours()) == 1
    finally:
        for entry in ours():
            warnings.filters.remove(entry)
