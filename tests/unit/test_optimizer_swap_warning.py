"""The monitored optimizer replaced mid-run (a new optimizer over the same parameters): rows stop, as
documented, and the warning that names that cause (after FOREIGN_STEPS of the new one) is the only one:
DDP's "reduced gradients more than once" (gradient accumulation without no_sync()), which the
replacement's extra backwards set off, is held back. A GAN's critic stepping several times per
generator step, or an inner loop's optimizer over the monitored parameters, is no replacement.

One gloo rank in one process (DDP around the model: its taps are what saw the second reduce)."""

from __future__ import annotations

import copy
import json
import logging
import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")
STEPS = 20  # the swap at step 2, then FOREIGN_STEPS (16) steps of the new optimizer


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _swap(rank: int, world: int, out_root: str) -> dict:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, "cfg.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": list(OPS), "ndigits": 12}, fh)
    model = _net()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    lines = _Lines()
    logging.getLogger("trainermon").addHandler(lines)
    try:
        monitor = TrainerMon(cfg)
        monitor.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
        gen = torch.Generator().manual_seed(7)
        expected = {}
        said_at = {}
        for step in range(STEPS):
            if step == 2:  # the user's new optimizer, not given to the monitor
                opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
                ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
            x = torch.randn(4, 6, generator=gen)
            ddp(x).pow(2).mean().backward()
            reference(x).pow(2).mean().backward()
            for n, p in reference.named_parameters():
                expected[(n, step, None)] = ref_stats(p.grad)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            for i in range(len(lines.lines)):
                said_at.setdefault(i, step)
        monitor.close()
        assert monitor.faults.total == 0, dict(monitor.faults.counts)
    finally:
        logging.getLogger("trainermon").removeHandler(lines)
    rows = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    assert {s for (_, s, _) in rows} == {0, 1}  # rows stop with the replaced optimizer (documented)
    for key, row in rows.items():
        assert_row_matches(row, expected[key], OPS)
    return {"lines": lines.lines, "said_at": said_at}


def _critic(rank: int, world: int, out_root: str) -> list[str]:
    """A GAN-like loop: the monitored optimizer steps `g`, a critic's optimizer steps `d` (also monitored)
    three times per step of ours."""
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, "cfg.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": list(OPS)}, fh)
    torch.manual_seed(0)
    model = nn.ModuleDict({"g": nn.Linear(4, 4), "d": nn.Linear(4, 1)})
    opt_g = torch.optim.SGD(model["g"].parameters(), lr=0.01)
    opt_d = torch.optim.SGD(model["d"].parameters(), lr=0.01)
    lines = _Lines()
    logging.getLogger("trainermon").addHandler(lines)
    try:
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt_g)
        for _ in range(4):
            for _ in range(3):
                model["d"](model["g"](torch.randn(2, 4)).detach()).mean().backward()
                opt_d.step()
                opt_d.zero_grad()
            model["d"](model["g"](torch.randn(2, 4))).mean().backward()
            opt_g.step()
            opt_g.zero_grad()
            opt_d.zero_grad()
        monitor.close()
    finally:
        logging.getLogger("trainermon").removeHandler(lines)
    return lines.lines


def test_replaced_optimizer_is_named_and_not_taken_for_a_double_reduce(tmp_path):
    got = run_ranks(_swap, world_size=1, out_root=str(tmp_path))[0]
    lines, said_at = got["lines"], got["said_at"]
    twice = [i for i, line in enumerate(lines) if "more than once in one step" in line]
    replaced = [i for i, line in enumerate(lines) if "If the optimizer was replaced" in line]
    assert not twice, lines
    assert replaced, lines
    assert len(replaced) == 1 and said_at[replaced[0]] == 2 + 16 - 1, (said_at, lines)  # swapped at step 2


def test_gan_critic_is_no_replacement(tmp_path):
    lines = run_ranks(_critic, world_size=1, out_root=str(tmp_path))[0]
    assert not [line for line in lines if "If the optimizer was replaced" in line], lines


def _inner_loop(rank: int, world: int, out_root: str) -> list[str]:
    """Reptile-like: from step 3 an inner optimizer over the same parameters steps twice before the
    monitored (meta) optimizer, which steps every step."""
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, "cfg.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": list(OPS)}, fh)
    model = _net()
    meta = torch.optim.SGD(model.parameters(), lr=0.01)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    lines = _Lines()
    logging.getLogger("trainermon").addHandler(lines)
    try:
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=meta)
        for step in range(10):
            for _ in range(2 if step >= 3 else 0):
                model(torch.randn(2, 6)).pow(2).mean().backward()
                inner.step()
                inner.zero_grad()
            model(torch.randn(2, 6)).pow(2).mean().backward()
            meta.step()
            meta.zero_grad()
        monitor.close()
    finally:
        logging.getLogger("trainermon").removeHandler(lines)
    return lines.lines


def test_inner_loop_optimizer_is_no_replacement(tmp_path):
    lines = run_ranks(_inner_loop, world_size=1, out_root=str(tmp_path))[0]
    assert not [line for line in lines if "If the optimizer was replaced" in line], lines
