"""`module_ranks` with msprobe's meaning, the ranks to monitor: a rank not listed writes no per-rank rows
(actv, actv_grad, grad_unreduced and its per-micro-batch rows, comm) and still takes part in every collective
(the cross-rank summaries, the merges of the job's rows); the job's one-writer rows (grad_reduced) stay
where they are (README `module_ranks`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from tests.helpers import keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")
PER_RANK = ("actv", "actv_grad", "grad_unreduced", "comm")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _run(tmp: str, rank: int, micro_batches: int) -> dict:
    """3 DDP steps of `micro_batches` backwards each, module_ranks [1], xrank summaries on."""
    from torch.nn.parallel import DistributedDataParallel

    from trainermon import TrainerMon

    out = os.path.join(tmp, f"mb{micro_batches}")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.makedirs(out, exist_ok=True)
    cfg = write_config(
        Path(out) / f"cfg{rank}.json",
        xy_distribution=True,
        wg_distribution=True,
        monitor_mbs_grad=micro_batches > 1,
        module_ranks=[1],
        xrank_summary=True,
        ops=list(OPS),
        cc_distribution={"enable": True},
    )
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=micro_batches, optimizer=opt)
    for step in range(3):
        for micro in range(micro_batches):
            model(_batch(rank, step, micro)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    families = (*PER_RANK, "comm", "grad_reduced", "xrank")
    return {f: read_family(monitor.run_dir, f) for f in families}


def _reference(world_size: int, micro_batches: int) -> dict:
    """float64 statistics of step 0's gradients (initial weights): each micro-batch's own on each rank
    ((rank, micro, name)), and the reduced one (name): DDP's mean over ranks of the accumulated sums."""
    model = _model().double()
    grads = {}
    for r in range(world_size):
        for micro in range(micro_batches):
            model.zero_grad()
            model(_batch(r, 0, micro).double()).square().sum().backward()
            grads.update({(r, micro, n): p.grad.clone() for n, p in model.named_parameters()})
    names = [n for n, _ in model.named_parameters()]
    out: dict = {k: ref_stats(g) for k, g in grads.items()}  # floats: tensors do not cross processes
    for n in names:
        out[n] = ref_stats(
            sum(grads[r, m, n] for r in range(world_size) for m in range(micro_batches)) / world_size
        )
    return out


def _on_rank(rank: int, world_size: int, out: str) -> dict:
    return {mb: (_run(out, rank, mb), _reference(world_size, mb)) for mb in (1, 2)}


def _close(row: dict, ref: dict) -> bool:
    return all(abs(float(row[op]) - ref[op]) <= 1e-5 * abs(ref[op]) + 1e-6 for op in OPS)


def test_ranks_outside_module_ranks_write_no_per_rank_rows(tmp_path):
    """2 gloo DDP ranks, module_ranks [1]: rank 0 writes no actv/actv_grad/grad_unreduced row (old code:
    its grad_unreduced rows), rank 1 writes them with a float64 reference's values (per micro-batch with
    monitor_mbs_grad); rank 0 still writes grad_reduced (the mean of both ranks' gradients) and the xrank
    summaries, which count one rank per grad_unreduced row: no rank hung in any collective."""
    from tests.distributed import run_ranks

    found = run_ranks(_on_rank, world_size=2, timeout=400, out=str(tmp_path))
    for mb in (1, 2):
        (rank0, ref), (rank1, _) = found[0][mb], found[1][mb]
        for family in PER_RANK:
            assert rank0[family] == [], (mb, family, rank0[family][:2])
            assert rank1[family], (mb, family)
        grads = keyed(rank1["grad_unreduced"])
        for (name, step, micro), row in grads.items():
            if step == 0:
                assert (micro is None) is (mb == 1)
                assert _close(row, ref[1, micro or 0, name]), (mb, name, micro, row)
        assert {n for n, s, _m in grads if s == 0} == {"0.weight", "0.bias", "2.weight", "2.bias"}
        # grad_reduced: the job's one writer (rank 0) as without module_ranks
        assert rank1["grad_reduced"] == []
        reduced = keyed(rank0["grad_reduced"])
        for name in ("0.weight", "2.bias"):
            assert _close(reduced[name, 0, None], ref[name]), (mb, name)
        summaries = [r for r in rank0["xrank"] if r["family"] == "grad_unreduced"]
        assert summaries and {r["ranks"] for r in summaries} == {"1"}, summaries[:2]
        assert {r["step"] for r in rank0["xrank"]} == {"0", "1", "2"}
