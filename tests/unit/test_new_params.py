"""Parameters frozen at set_monitor and unfrozen later, and parameters given to the optimizer later with
`add_param_group` (of a frozen module, or of a module added to the model after set_monitor), are
monitored from the step in which they start training, exactly, with one log line."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")
ITERATIONS, THAW = 4, 2


@pytest.mark.parametrize("how", ["unfreeze", "add_param_group", "new_module"])
def test_parameters_that_start_training_later_are_picked_up(tmp_path, monkeypatch, caplog, how):
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, mv_distribution=True, param_distribution=True,
        ops=list(OPS), ndigits=12,
    )  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    late, late_name = model[2], "2"
    late.requires_grad_(False)
    if how == "new_module":  # not in the model until it is appended, then added to the optimizer
        late, late_name = nn.Linear(2, 2), "5"
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    elif how == "unfreeze":  # in the optimizer from the start, frozen
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    else:  # not in the optimizer until it is added
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)

    gen = torch.Generator().manual_seed(3)
    expected: dict[tuple, dict[str, float]] = {}
    with caplog.at_level(logging.INFO, logger="trainermon"):
        for it in range(ITERATIONS):
            if it == THAW:
                late.requires_grad_(True)
                if how == "new_module":
                    model.append(late)
                if how != "unfreeze":
                    opt.add_param_group({"params": list(late.parameters()), "lr": 0.02})
            model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    expected[("grad_reduced", n, it)] = ref_stats(p.grad)
                    expected[("param_origin", n, it)] = ref_stats(p)
            opt.step()
            for n, p in model.named_parameters():
                if p in opt.state and "exp_avg" in opt.state[p]:
                    expected[("exp_avg", n, it)] = ref_stats(opt.state[p]["exp_avg"])
            opt.zero_grad()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)

    lines = [r.getMessage() for r in caplog.records if "became trainable" in r.getMessage()]
    assert len(lines) == 1 and f"{late_name}.weight" in lines[0] and f"{late_name}.bias" in lines[0], lines
    for family in ("grad_reduced", "param_origin", "exp_avg"):
        rows = keyed(read_family(monitor.run_dir, family))
        want = {(n, s, None) for (f, n, s) in expected if f == family}
        assert set(rows) == want, (family, sorted(set(rows) ^ want))
        assert (f"{late_name}.weight", THAW, None) in rows, family
        assert (f"{late_name}.weight", THAW - 1, None) not in rows, family
        for (n, s, _m), row in rows.items():
            assert_row_matches(row, expected[(family, n, s)], OPS)
