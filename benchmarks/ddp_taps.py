"""Iteration time of a DDP model (world 1, gloo) with trainermon attached, on steps that are not collected.

    PYTHONPATH=. python benchmarks/ddp_taps.py 100 monitor     # 200 parameters, monitor attached
    PYTHONPATH=. python benchmarks/ddp_taps.py 100             # no monitor

Prints the median and the minimum of 7 rounds of 50 iterations (forward, backward, step, zero_grad) of a
stack of tiny Linear layers: the per-parameter cost of the pre-reduce taps dominates any compute.
"""

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])  # 2*layers parameters
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    out = tempfile.mkdtemp()
    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out, "c.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "start_step": 10**9}, fh)  # attached, nothing collected
    if sys.argv[2:] == ["monitor"]:
        from trainermon import TrainerMon

        TrainerMon(cfg).set_monitor(ddp, optimizer=opt)
    x = torch.randn(8, 16)

    def iteration() -> None:
        ddp(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(30):
        iteration()
    rounds = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(50):
            iteration()
        rounds.append((time.perf_counter() - start) / 50 * 1e3)
    rounds.sort()
    print(f"{sys.argv[2:] or ['none']} params={2 * layers} median_ms={rounds[3]:.3f} min_ms={rounds[0]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
