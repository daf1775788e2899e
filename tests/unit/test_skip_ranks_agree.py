"""A backward cleared without a step is a skipped step only on evidence (a non-finite gradient), which is
read where every rank holds the same gradients (DDP). Elsewhere ranks hold different ones: two pipeline
stages (torch.distributed.pipelining, 2 gloo ranks), one of whose gradients overflows, must still count
the same steps; deciding from each rank's own gradients split the step counters and hung the job in the
monitor's next collective (review of session 44)."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

D, MICRO, ITERS = 8, 2, 4


def _stages(rank: int, world_size: int, out: str) -> list[int]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out, f"cfg{rank}.json")
    os.makedirs(out, exist_ok=True)
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": ["norm"]}, fh)
    torch.manual_seed(rank)
    part = nn.Sequential(nn.Linear(D, D), nn.Tanh()) if rank == 0 else nn.Sequential(nn.Linear(D, 1))
    stage = PipelineStage(part, rank, world_size, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, MICRO, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    opt = torch.optim.SGD(part.parameters(), lr=1e-2)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(part, optimizer=opt, grad_acc_steps=MICRO)
    seen = []
    for it in range(ITERS):
        gen = torch.Generator().manual_seed(it)
        x, y = torch.randn(4, D, generator=gen), torch.randn(4, 1, generator=gen)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
            if it == 1:
                part[0].bias.grad.fill_(float("inf"))  # an overflow on this stage only
        bad = torch.tensor([float(not all(torch.isfinite(p.grad).all() for p in part.parameters()))])
        dist.all_reduce(bad)  # the loop skips its step on every rank when any rank overflowed
        if bad.item() == 0:
            opt.step()
        opt.zero_grad()
        seen.append(monitor.current_step)
    monitor.close()
    return seen


def test_pipeline_stages_count_a_skipped_step_alike(tmp_path):
    from tests.distributed import run_ranks

    found = run_ranks(_stages, world_size=2, timeout=180, out=str(tmp_path))
    # iteration 1 skipped its step on both ranks: still a step (closed as skipped), on both alike
    assert found[0] == found[1] == [1, 2, 3, 4], found
