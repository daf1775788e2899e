"""set_monitor is collective: a rank that is late (within TRAINERMON_SET_MONITOR_TIMEOUT_S) is waited for
and the run is monitored as usual; a monitor on rank 0 only (a common mistake) fails within that bound,
with a ConfigError naming the missing rank, instead of hanging in the first collective until the process
group's timeout (30 min) without a word. One launch of 2 gloo ranks (a few seconds).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")
BOUND_S = 4.0
TIMEOUT_VAR = "TRAINERMON_SET_MONITOR_TIMEOUT_S"  # (trainermon.runtime.arrival)
LATE_S = 1.5  # rank 1's delay before set_monitor, within the bound


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _ranks(rank: int, world: int, out_root: str) -> dict:
    from trainermon import TrainerMon
    from trainermon.config.values import ConfigError

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "out")
    cfg = os.path.join(out_root, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": list(OPS), "ndigits": 12}, fh)

    # 1. Rank 1 arrives late, within the bound: both attach; rows as usual.
    model = _net()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    if rank == 1:
        time.sleep(LATE_S)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(ddp, optimizer=opt)
    gen = torch.Generator().manual_seed(100 + rank)
    expected = {}
    for step in range(2):
        x = torch.randn(4, 6, generator=gen)
        ddp(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        for n, p in reference.named_parameters():
            expected[(n, step, None)] = ref_stats(p.grad)  # this rank's own (unreduced) gradient
            averaged = p.grad.clone()
            dist.all_reduce(averaged)
            p.grad.copy_(averaged / world)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    monitor.close()
    rows = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    assert set(rows) == set(expected)
    for key, row in rows.items():
        assert_row_matches(row, expected[key], OPS)

    # 2. A monitor on rank 0 only: rank 0's set_monitor raises within the bound; rank 1 never calls it (it
    # waits in the store, not in a collective, so that nothing of rank 0's can pair with it).
    store = dist.distributed_c10d._get_default_store()
    result: dict = {"rows": len(rows)}
    if rank == 0:
        import logging

        from trainermon.runtime import arrival

        arrival.WARN_AFTER_S = 1.0  # the warning on the way, well before the bound
        warned: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("trainermon").addHandler(handler)
        lone = TrainerMon(cfg)
        began = time.monotonic()
        try:
            lone.set_monitor(_net(), optimizer=None)
        except ConfigError as exc:
            result.update(error=str(exc), took=time.monotonic() - began)
        finally:
            store.set("test/rank0_done", b"1")
            logging.getLogger("trainermon").removeHandler(handler)
        result["warned"] = [m for m in warned if "has waited" in m]
    else:
        store.wait(["test/rank0_done"], datetime.timedelta(seconds=120))
    return result


def test_late_rank_is_waited_for_and_missing_rank_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMEOUT_VAR, str(BOUND_S))
    # The old code hangs in dist.new_group for the group's 30-min timeout: the launch's own bound ends it.
    results = run_ranks(_ranks, world_size=2, timeout=120, out_root=str(tmp_path))
    assert results[0]["rows"] == results[1]["rows"] == 2 * 4  # 2 steps x 4 parameters on each rank
    error, took = results[0].get("error"), results[0].get("took")
    assert error is not None, "set_monitor on rank 0 alone did not raise"
    assert BOUND_S - 0.1 <= took <= BOUND_S + 10, took
    assert "set_monitor is collective" in error and "every rank must call it" in error
    assert "rank(s) 1 of 2" in error and TIMEOUT_VAR in error
    # ... and named in a warning while still waiting (once)
    (warning,) = results[0]["warned"]
    assert "for rank(s) 1:" in warning and "set_monitor is collective" in warning
