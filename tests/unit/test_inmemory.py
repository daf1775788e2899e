"""msprobe's in-memory metrics API (`generate_wgrad_metrics`, `generate_xy_metrics`) and its "api" format:
a step's statistics read back as `{msprobe tag: {statistic: tensor}}` after the optimizer step, checked
against float64 references of the same step's gradients and activations computed in the test; the "api"
format writes no file; a step that is not collected gives the last collected one; a family switched off
gives ({}, {}) and says so once."""

from __future__ import annotations

import glob
import logging
import math
import os

import pytest
import torch
from torch import nn

from tests.helpers import ref_stats, write_config
from trainermon import TrainerMon

OPS = ["norm", "min", "max", "mean"]
#: float32 statistics: sums within 16 u sum|x| (the engine's bound, u = 2^-24), min and max exact
REL = 1e-5


def _close(got: dict, want: dict) -> None:
    assert set(got) == {*OPS, "shape", "dtype"}, got  # shape and dtype always, as msprobe gives them
    assert got["shape"] == want["shape"] and got["dtype"] == want["dtype"], got
    for op in OPS:
        value = float(got[op])
        assert got[op].dtype == torch.float64 and got[op].dim() == 0
        if op in ("min", "max"):
            assert value == want[op], (op, value, want[op])
        else:
            assert math.isclose(value, want[op], rel_tol=REL, abs_tol=1e-7), (op, value, want[op])


def _ref(t: torch.Tensor) -> dict:
    return {**ref_stats(t), "shape": t.shape, "dtype": t.dtype}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train_and_read(cfg: str, steps: int) -> tuple[TrainerMon, list]:
    """Each step: the references (gradients before the update, activations of the forward) and what the
    monitor gives after the optimizer step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    assert monitor.generate_wgrad_metrics() == ({}, {})  # no step yet
    hidden: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, i, o: hidden.append(o.detach().clone()))
    seen = []
    for step in range(steps):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        out = model(x)  # one forward a step: another would be a second micro-batch to the monitor
        out.square().sum().backward()
        out = out.detach()
        want = {
            "grads": {n: _ref(p.grad) for n, p in model.named_parameters()},
            "actv": {"0.output": _ref(hidden[-1]), "2.output": _ref(out)},
            "actv_grad": {"2.output": _ref(2 * out)},  # d(sum out^2)/d out
        }
        opt.step()
        opt.zero_grad()
        seen.append((want, monitor.generate_wgrad_metrics(), monitor.generate_xy_metrics()))
    return monitor, seen


def test_wgrad_and_xy_metrics_are_the_steps_statistics(tmp_path, out_dir):
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, xy_distribution=True, ops=OPS, format="api")
    monitor, seen = _train_and_read(cfg, steps=2)
    monitor.close()
    for want, (reduced, unreduced), (actv, actv_grad) in seen:
        names = ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert sorted(reduced) == sorted(f"0:{n}/rank0/post_grad" for n in names)
        assert sorted(unreduced) == sorted(f"0:{n}/rank0/acc_grad" for n in names)
        for n in names:  # one process: the gradient before and after the (absent) reduction
            _close(reduced[f"0:{n}/rank0/post_grad"], want["grads"][n])
            _close(unreduced[f"0:{n}/rank0/acc_grad"], want["grads"][n])
        for name, ref in want["actv"].items():
            _close(actv[f"0:{name}:0/rank0/actv"], ref)
        for name, ref in want["actv_grad"].items():
            _close(actv_grad[f"0:{name}:0/rank0/actv_grad"], ref)
    assert not os.path.exists(monitor.run_dir) or not os.listdir(monitor.run_dir)  # "api": no files
    assert monitor.faults.total == 0
    # msprobe 26.2's argument: accepted and ignored (test_msprobe_config), the same statistics come back
    given = monitor.generate_wgrad_metrics({"0:0.weight/rank0/post_grad": torch.ones(2)})
    assert set(given[0]) == set(reduced)


def test_a_step_not_collected_gives_the_last_collected_one(tmp_path, out_dir):
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, ops=OPS, step_interval=2)
    monitor, seen = _train_and_read(cfg, steps=2)
    monitor.close()
    (want0, (reduced0, _), _), (_, (reduced1, _), _) = seen
    assert reduced1 == reduced0 and reduced0  # step 1 is not collected: step 0's values again
    _close(reduced1["0:0.weight/rank0/post_grad"], want0["grads"]["0.weight"])


def test_a_family_switched_off_gives_nothing_and_says_so_once(tmp_path, out_dir, caplog):
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, ops=OPS)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor, seen = _train_and_read(cfg, steps=2)
    monitor.close()
    assert all(xy == ({}, {}) for _, _, xy in seen)
    assert all(reduced for _, (reduced, _), _ in seen)
    said = [r for r in caplog.records if "generate_xy_metrics(): xy_distribution is off" in r.getMessage()]
    assert len(said) == 1


def test_calls_every_step_cut_no_parquet_parts(tmp_path, out_dir):
    """The calls wait for the worker without flushing the sinks: one Parquet part per family for the run
    (a flush per call used to complete a part per family per step)."""
    pytest.importorskip("pyarrow")
    cfg = write_config(
        tmp_path / "c.json", wg_distribution=True, xy_distribution=True, ops=OPS, format="parquet"
    )
    monitor, seen = _train_and_read(cfg, steps=4)
    assert all(reduced for _, (reduced, _), _ in seen)  # each call gave its step's statistics
    monitor.close()
    parts = glob.glob(os.path.join(str(out_dir), "**", "*.parquet"), recursive=True)
    families = {os.path.relpath(p, str(out_dir)).split(os.sep)[1] for p in parts}  # parquet/family=.../
    assert families >= {"family=actv", "family=grad_reduced"} and len(parts) == len(families), sorted(parts)
