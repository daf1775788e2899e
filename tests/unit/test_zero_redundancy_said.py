"""torch's ZeroRedundancyOptimizer keeps each parameter's optimizer state whole on its owning rank, in the
wrapped optimizer (`.optim`); its own `.state` stays empty. trainermon reads it there (it used to warn
that it did not): on one gloo rank (a real ZeroRedundancyOptimizer needs a process group) the exp_avg
rows are that state's, no warning is given, and the gradient rows stay right. Several ranks:
tests/adapters/test_zero_redundancy.py."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from tests.distributed import free_port
from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon


def test_zero_redundancy_optimizer_state_is_read_on_one_rank(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, mv_distribution=True, ops=["norm"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        monitor = TrainerMon(cfg)
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            monitor.set_monitor(model, optimizer=opt)
            want, state = {}, {}
            for step in range(2):
                model(torch.randn(4, 6)).square().sum().backward()
                for name, p in model.named_parameters():
                    want[(name, step, None)] = float(p.grad.double().norm())
                opt.step()
                for name, p in model.named_parameters():
                    state[(name, step, None)] = float(opt.optim.state[p]["exp_avg"].double().norm())
                opt.zero_grad()
            monitor.close()
        assert len(opt.optim.state) == 2  # the state exists, in the wrapped optimizer
    finally:
        dist.destroy_process_group()
    said = [r.getMessage() for r in caplog.records if "mv_distribution writes nothing" in r.getMessage()]
    assert said == []
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert set(rows) == set(want)
    for key, norm in want.items():
        assert abs(float(rows[key]["norm"]) - norm) <= 1e-5 * norm  # 6 significant digits written
    moments = keyed(read_family(monitor.run_dir, "exp_avg"))
    assert set(moments) == set(state)
    for key, norm in state.items():
        assert abs(float(moments[key]["norm"]) - norm) <= 1e-5 * norm
