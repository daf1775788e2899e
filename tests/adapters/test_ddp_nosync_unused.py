"""DDP (find_unused_parameters) on 2 gloo ranks with no_sync() accumulation, where the syncing micro-batch
leaves a parameter unused on one rank (layer drop): DDP still all-reduces that rank's accumulated gradient,
so grad_unreduced must hold it (the rank's own local gradient before the reduce), with and without
gradient_as_bucket_view (which divides the bucket in place during the backward).

The reference on each rank is an unwrapped copy fed the same data; the average is all-reduced by the test.
"""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.drop = nn.Linear(4, 4)  # dropped in some micro-batches
        self.never = nn.Linear(4, 4)  # rank 0: never used (no local gradient, no row); rank 1: syncing only

    def forward(self, x: torch.Tensor, use_drop: bool, use_never: bool) -> torch.Tensor:
        h = self.drop(x) if use_drop else x
        h = self.never(h) if use_never else h
        return self.a(h)


def _uses(rank: int, step: int, micro: int) -> tuple[bool, bool]:
    """(drop used, never used) in this micro-batch; micro 1 is the syncing one."""
    if micro == 0:
        return True, False
    return rank == 1 or step == 1, rank == 1  # rank 0 drops `drop` in the syncing mb of step 0


def _case(rank: int, world: int, out_root: str, bucket_view: bool) -> None:
    from trainermon import TrainerMon

    out = os.path.join(out_root, f"bv{bucket_view}")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out_root, f"bv{bucket_view}-rank{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": list(OPS), "ndigits": 12}, fh)
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(ddp, grad_acc_steps=2, optimizer=opt)

    gen = torch.Generator().manual_seed(100 + rank)
    expected_un: dict[tuple, dict] = {}
    expected_red: dict[tuple, dict] = {}
    for step in range(2):
        for micro in range(2):
            x = torch.randn(3, 4, generator=gen)
            use = _uses(rank, step, micro)
            if micro == 0:
                with ddp.no_sync():
                    ddp(x, *use).pow(2).sum().backward()
            else:
                ddp(x, *use).pow(2).sum().backward()
            reference(x, *use).pow(2).sum().backward()
        for n, p in reference.named_parameters():
            local = p.grad if p.grad is not None else torch.zeros_like(p)
            if p.grad is not None:
                expected_un[(n, step, None)] = ref_stats(local)
            averaged = local.clone()
            dist.all_reduce(averaged)
            averaged /= world
            expected_red[(n, step, None)] = ref_stats(averaged)
            torch.testing.assert_close(dict(model.named_parameters())[n].grad, averaged)
            p.grad = averaged
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)

    unreduced = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    if rank == 0:  # the defect: drop's accumulated gradient of step 0 had no row on rank 0
        assert ("drop.weight", 0, None) in expected_un and ("never.weight", 0, None) not in expected_un
    assert set(unreduced) == set(expected_un)
    for key, row in unreduced.items():
        assert_row_matches(row, expected_un[key], OPS)
    reduced = keyed(read_family(monitor.run_dir, "grad_reduced"))
    if rank == 0:
        assert set(reduced) == set(expected_red)
        for key, row in reduced.items():
            assert_row_matches(row, expected_red[key], OPS)


def _stale(rank: int, world: int, out_root: str) -> None:
    """No no_sync(), zero_grad() between forward and backward (torch's ImageNet example), rank 0 leaving
    `drop` unused from step 1: the previous step's reduced gradient (still in .grad at the forward) is no
    accumulated gradient, so rank 0 writes no drop row at steps 1 and 2 (a review found one)."""
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "stale")
    cfg = os.path.join(out_root, f"stale-rank{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": list(OPS), "ndigits": 12}, fh)
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(200 + rank)
    expected: dict[tuple, dict] = {}
    for step in range(3):
        x = torch.randn(3, 4, generator=gen)
        use = (rank == 1 or step == 0, False)
        loss = ddp(x, *use).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        reference.zero_grad()
        reference(x, *use).pow(2).sum().backward()
        for n, p in reference.named_parameters():
            if p.grad is not None:
                expected[(n, step, None)] = ref_stats(p.grad)
        opt.step()
        with torch.no_grad():
            for p, q in zip(reference.parameters(), model.parameters()):
                p.copy_(q)
    monitor.close()
    unreduced = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    if rank == 0:
        assert ("drop.weight", 1, None) not in expected
    assert set(unreduced) == set(expected)
    for key, row in unreduced.items():
        assert_row_matches(row, expected[key], OPS)


def _both(rank: int, world: int, out_root: str) -> int:
    for bucket_view in (False, True):
        _case(rank, world, out_root, bucket_view)
    _stale(rank, world, out_root)
    return 2


def test_unused_in_syncing_microbatch_keeps_its_unreduced_row(tmp_path):
    assert run_ranks(_both, world_size=2, out_root=str(tmp_path)) == [2, 2]
