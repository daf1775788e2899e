"""Golden run: every family's values match an independent reference recomputed with plain torch.

Two identical seeded models train in lockstep on the same data: one monitored by trainermon, one
instrumented by the test itself (its own forward hooks, torch's full backward hooks, clones of .grad and
of the optimizer state), so the reference shares no code path with the monitor.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config
from trainermon import TrainerMon
from trainermon.collect.records import FAMILIES

OPS = ("norm", "mean", "min", "max", "nans")
STEPS = 3
GRAD_ACC = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.norm(self.fc1(x))))


def _batches(seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(5, 6, generator=gen) for _ in range(GRAD_ACC)] for _ in range(STEPS)]


def _reference_run(model: nn.Module, batches, mbs: bool = False) -> dict[tuple, dict[str, float]]:
    """(family, name, step, micro_step) -> reference statistics, from the test's own instrumentation."""
    ref: dict[tuple, dict[str, float]] = {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"step": 0, "micro": 0}
    for mod_name, module in model.named_children():

        def fwd(mod, args, out, name=mod_name):
            s, m = state["step"], state["micro"]
            ref[("actv", f"{name}.input", s, m)] = ref_stats(args[0])
            ref[("actv", f"{name}.output", s, m)] = ref_stats(out)

        def bwd(mod, grad_in, grad_out, name=mod_name):
            s, m = state["step"], state["micro"]
            ref[("actv_grad", f"{name}.output", s, m)] = ref_stats(grad_out[0])
            if grad_in[0] is not None:
                ref[("actv_grad", f"{name}.input", s, m)] = ref_stats(grad_in[0])

        module.register_forward_hook(fwd)
        module.register_full_backward_hook(bwd)
    for step, micro_batches in enumerate(batches):
        state["step"] = step
        previous = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for micro, x in enumerate(micro_batches):
            state["micro"] = micro
            (model(x).pow(2).mean() / GRAD_ACC).backward()
            if mbs:
                for n, p in model.named_parameters():
                    ref[("grad_unreduced", n, step, micro)] = ref_stats(p.grad - previous[n])
                    previous[n] = p.grad.clone()
        for n, p in model.named_parameters():
            if not mbs:
                ref[("grad_unreduced", n, step, None)] = ref_stats(p.grad)
            ref[("grad_reduced", n, step, None)] = ref_stats(p.grad)
            ref[("param_origin", n, step, None)] = ref_stats(p)
        opt.step()
        for n, p in model.named_parameters():
            ref[("exp_avg", n, step, None)] = ref_stats(opt.state[p]["exp_avg"])
            ref[("exp_avg_sq", n, step, None)] = ref_stats(opt.state[p]["exp_avg_sq"])
            ref[("param_updated", n, step, None)] = ref_stats(p)
        opt.zero_grad()
    return ref


def _monitored_run(model: nn.Module, batches, config_path: str) -> TrainerMon:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(config_path)
    monitor.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=opt)
    for micro_batches in batches:
        for x in micro_batches:
            (model(x).pow(2).mean() / GRAD_ACC).backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor


@pytest.mark.parametrize("mbs", [False, True], ids=["step-grads", "micro-batch-grads"])
def test_every_family_matches_reference(tmp_path, out_dir, mbs):
    cfg = write_config(
        tmp_path / "cfg.json",
        xy_distribution=True,
        all_xy=True,
        wg_distribution=True,
        monitor_mbs_grad=mbs,
        mv_distribution=True,
        param_distribution=True,
        ops=list(OPS),
        ndigits=12,
    )
    torch.manual_seed(0)
    model = Net()
    reference_model = copy.deepcopy(model)
    batches = _batches()
    monitor = _monitored_run(model, batches, cfg)
    ref = _reference_run(reference_model, batches, mbs=mbs)
    assert monitor.faults.total == 0

    for family in FAMILIES:
        rows = keyed(read_family(monitor.run_dir, family))
        expected = {(n, s, m) for (f, n, s, m) in ref if f == family}
        assert set(rows) == expected, f"{family}: rows differ from the reference"
        for (name, step, micro), row in rows.items():
            assert_row_matches(row, ref[(family, name, step, micro)], OPS)
            assert row["dtype"] == "torch.float32"
    # The two trainings stayed in lockstep, so the comparison above compared the same tensors.
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q)


def test_csv_layout_is_msprobes(tmp_path, out_dir):
    cfg = write_config(tmp_path / "cfg.json", xy_distribution=True, wg_distribution=True, ops=["min", "norm"])
    torch.manual_seed(0)
    monitor = _monitored_run(Net(), _batches(), cfg)
    import os
    import re

    assert re.fullmatch(
        r"[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}-rank0-[0-9a-f]{8}", os.path.basename(monitor.run_dir)
    )
    with open(os.path.join(monitor.run_dir, "actv_0-0.csv")) as fh:
        # msprobe's columns in msprobe's order, then trainermon's own (appended, so readers by name work)
        assert fh.readline().strip() == "vpp_stage,name,step,micro_step,min,norm,shape,dtype,shard,skipped"
    with open(os.path.join(monitor.run_dir, "grad_reduced_1-1.csv")) as fh:
        assert fh.readline().strip() == "vpp_stage,name,step,min,norm,shape,dtype,shard,skipped"
        first = fh.readline().strip()
    # shard and skipped are empty (a whole tensor, a torch step that ran)
    assert first.startswith("0,fc1.weight,1,") and first.endswith(',"[16, 6]",torch.float32,,')
