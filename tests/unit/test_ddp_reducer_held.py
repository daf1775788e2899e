"""Which parameters DDP's reducer holds (`adapters/ddp_taps.py` `_reducer_held`), on one gloo rank: when
nothing was frozen or unfrozen since DDP was built, the trainable parameters are taken without reading the
reducer's buckets (that read allocates a zero copy of every bucketed gradient: a memory spike on a large
model); when something was, the buckets are read and give the exact set."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.distributed import run_ranks


class _Counting:
    """DDP's reducer, counting the reads of its buckets."""

    def __init__(self, reducer) -> None:
        self.reducer, self.reads = reducer, 0

    def _get_zeros_like_grad_buckets(self):
        self.reads += 1
        return self.reducer._get_zeros_like_grad_buckets()


def _held(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon.adapters.ddp_taps import DdpReduceTaps

    def names(model, ids):
        return sorted(n for n, p in model.named_parameters() if id(p) in ids)

    out = {}
    for case in ("unchanged", "frozen-after-build", "unfrozen-after-build"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
        if case == "unfrozen-after-build":
            model[0].requires_grad_(False)
        ddp = DDP(model)
        counting = ddp.reducer = _Counting(ddp.reducer)
        if case == "frozen-after-build":
            model[1].requires_grad_(False)
        elif case == "unfrozen-after-build":
            model[0].requires_grad_(True)
        held = DdpReduceTaps._reducer_held(SimpleNamespace(_ddps=[ddp]))
        out[case] = (names(model, held), counting.reads)
    return out


def test_reducer_held_reads_buckets_only_when_flags_changed():
    res = run_ranks(_held, world_size=1, timeout=120)[0]
    every = ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert res["unchanged"] == (every, 0)  # no bucket read: no allocation
    assert res["frozen-after-build"] == (every, 1)  # still reduced by DDP
    assert res["unfrozen-after-build"] == (["1.bias", "1.weight"], 1)  # never reduced
