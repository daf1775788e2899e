"""DDP that `set_monitor` does not get directly, on 2 gloo ranks: `torch.compile(DDP(m))` (the DDP is the
compiled wrapper's `_orig_mod`), and `set_monitor(m)` while `DDP(m)` (eager or compiled) trains it, the DDP
made before or after `set_monitor`. grad_unreduced must be each rank's own local gradient (it was DDP's
average on every rank, silently), grad_reduced the average, written by rank 0 alone.

The reference on each rank is a non-DDP copy of the model fed the same local data (its .grad is the local
gradient); the average is all-reduced by the test itself. All cases run in one launch."""

from __future__ import annotations

import copy
import json
import os

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")
# what set_monitor gets / what trains: "compiled_ddp" torch.compile(DDP(m)) for both; "inner" m while
# DDP(m) trains; "inner_compiled" m while torch.compile(DDP(m)) trains; "inner_late" m, DDP(m) made after
CASES = ("compiled_ddp", "inner", "inner_compiled", "inner_late")


def _case(rank: int, world: int, out_root: str, case: str) -> None:
    from trainermon import TrainerMon

    torch._dynamo.reset()
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, case)
    cfg = os.path.join(out_root, f"{case}-rank{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": list(OPS), "ndigits": 12}, fh)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    if case == "inner_late":
        monitor.set_monitor(model, optimizer=opt)
    ddp = DDP(model)
    run = torch.compile(ddp, backend="aot_eager") if case in ("compiled_ddp", "inner_compiled") else ddp
    if case != "inner_late":
        monitor.set_monitor(run if case == "compiled_ddp" else model, optimizer=opt)

    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    expected: dict[tuple, dict[str, float]] = {}
    for step in range(2):
        x = torch.randn(3, 4, generator=gen)
        run(x).square().sum().backward()
        reference(x).square().sum().backward()
        for (n, p), q in zip(reference.named_parameters(), model.parameters()):
            expected[("grad_unreduced", n, step)] = ref_stats(p.grad)
            averaged = p.grad.clone()
            dist.all_reduce(averaged)
            averaged /= world
            torch.testing.assert_close(q.grad, averaged)  # DDP did reduce
            expected[("grad_reduced", n, step)] = ref_stats(averaged)
            p.grad.copy_(averaged)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)

    unreduced = {(n, s): r for (n, s, _), r in keyed(read_family(monitor.run_dir, "grad_unreduced")).items()}
    # a DDP made after set_monitor is found at the end of step 0, whose gradients are reduced by then: no
    # row for step 0 rather than a wrong one
    first = 1 if case == "inner_late" else 0
    assert set(unreduced) == {(n, s) for (f, n, s) in expected if f == "grad_unreduced" and s >= first}, case
    for (n, s), row in unreduced.items():
        assert_row_matches(row, expected[("grad_unreduced", n, s)], OPS)
    reduced = {(n, s): r for (n, s, _), r in keyed(read_family(monitor.run_dir, "grad_reduced")).items()}
    if rank == 0:
        assert set(reduced) == {(n, s) for (f, n, s) in expected if f == "grad_reduced"}, case
        for (n, s), row in reduced.items():
            assert_row_matches(row, expected[("grad_reduced", n, s)], OPS)
    else:
        assert reduced == {}, case  # replicated: written once per data-parallel group
    with open(os.path.join(monitor.run_dir, "layout.json")) as fh:
        layout = json.load(fh)
    if case != "inner_late":  # layout.json is written at set_monitor, before the late DDP existed
        assert layout.get("grad_unreduced_kind") == "acc_grad", (case, layout)


def _all_cases(rank: int, world: int, out_root: str) -> int:
    for case in CASES:
        try:
            _case(rank, world, out_root, case)
        except AssertionError as exc:
            raise AssertionError(f"case {case}: {exc}") from exc
    return len(CASES)


def test_ddp_under_compile_or_around_the_module_gives_local_unreduced_gradients(tmp_path):
    assert run_ranks(_all_cases, world_size=2, out_root=str(tmp_path)) == [len(CASES)] * 2
