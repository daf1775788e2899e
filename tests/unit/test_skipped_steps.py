"""An iteration whose update GradScaler skips (an overflow) is its own step, flagged, never merged.

fp16 autocast on CPU with `torch.amp.GradScaler("cpu")`; iteration 2's loss is multiplied by Inf, so its
gradients overflow and `scaler.step` does not call `optimizer.step()`. The step counter stays the loop's
iteration counter (one step per `scaler.step` call).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config
from tests.sinks.test_prometheus import scrape, url_of, value

OPS = ("norm", "mean", "min", "max")
ITERATIONS, OVERFLOW = 5, 2


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("clear", ["optimizer_after_step", "optimizer_first", "model_after_step"])
def test_gradscaler_overflow_is_its_own_flagged_step(tmp_path, monkeypatch, clear):
    zero_grad_first = clear == "optimizer_first"
    import trainermon
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "cfg.json",
        xy_distribution=True,
        wg_distribution=True,
        param_distribution=True,
        ops=list(OPS) + ["nans", "infs"],
        ndigits=12,
        format=["csv", "parquet", "prometheus"],
    )
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)

    gen = torch.Generator().manual_seed(1)
    seen: dict[int, dict[str, torch.Tensor]] = {}  # what the optimizer receives (unscaled)
    before: dict[int, dict[str, torch.Tensor]] = {}
    for it in range(ITERATIONS):
        if zero_grad_first:
            opt.zero_grad()
        x = torch.randn(4, 8, generator=gen)
        before[it] = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        if it == OVERFLOW:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # as for clipping: .grad is now what the optimizer would use
        seen[it] = {n: p.grad.clone() for n, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        if clear == "optimizer_after_step":
            opt.zero_grad()
        elif clear == "model_after_step":
            model.zero_grad()
    if zero_grad_first:
        opt.zero_grad()  # closes the last iteration, like the next iteration would
    monitor.flush()
    samples = scrape(url_of(monitor))
    assert value(samples, "trainermon_skipped_steps_total") == 1
    assert value(samples, "trainermon_steps_collected_total") == ITERATIONS
    monitor.close()
    assert "zero_grad" not in vars(opt) and "zero_grad" not in vars(model)  # close() undid the patches
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert scaler.get_scale() < 2.0**10  # the overflow really happened and was skipped
    for n, _p in model.named_parameters():  # iteration 2 changed nothing: the update was skipped
        torch.testing.assert_close(before[OVERFLOW + 1][n], before[OVERFLOW][n], rtol=0, atol=0)

    # One step per iteration, each with exactly one micro-step of activations (nothing merged).
    actv = keyed(read_family(monitor.run_dir, "actv"))
    assert sorted({s for _, s, _ in actv}) == list(range(ITERATIONS))
    assert {m for _, _, m in actv} == {0}
    per_step = [sum(1 for _, s, _ in actv if s == it) for it in range(ITERATIONS)]
    assert len(set(per_step)) == 1 and per_step[0] > 0, per_step
    assert {s for _, s, _ in keyed(read_family(monitor.run_dir, "actv_grad"))} == set(range(ITERATIONS))

    # The overflowing iteration's gradients are written, with their non-finite values counted.
    reduced = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert {s for _, s, _ in reduced} == set(range(ITERATIONS))
    for (n, s, _m), row in reduced.items():
        ref = ref_stats(seen[s][n])
        if s == OVERFLOW:
            assert float(row["nans"]) + float(row["infs"]) == ref["nans"] + ref["infs"] > 0, row
        else:
            assert_row_matches(row, ref, OPS)
    # The flag: CSV's last column (1 on the skipped step, empty where no one said), Parquet's `skipped`.
    assert {row["skipped"] for (_, s, _), row in reduced.items() if s == OVERFLOW} == {"1"}
    assert {row["skipped"] for (_, s, _), row in reduced.items() if s != OVERFLOW} == {""}
    assert list(reduced.values())[0].keys() and list(list(reduced.values())[0])[-1] == "skipped"
    origin = keyed(read_family(monitor.run_dir, "param_origin"))
    for (n, s, _m), row in origin.items():
        assert_row_matches(row, ref_stats(before[s][n]), OPS)

    table = trainermon.load(str(tmp_path / "out"), family="grad_reduced", as_pandas=True)
    flags = table.groupby("step")["skipped"].agg(lambda v: set(v.tolist()))
    assert flags[OVERFLOW] == {True}
    own = table.groupby("step")["own_skip"].agg(lambda v: set(v.tolist()))
    assert own[OVERFLOW] == {False}  # the scaler's overflow, not the loop's own skip
    assert all(True not in flags[s] for s in range(ITERATIONS) if s != OVERFLOW), flags


def _ddp_scaler(rank: int, world: int, out_root: str) -> int:
    import copy
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, f"rank{rank}.json")
    with open(cfg, "w") as fh:
        fh.write(
            '{"wg_distribution": true, "ops": ["norm", "mean", "min", "max", "nans", "infs"], "ndigits": 12}'
        )
    model = _net()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(10 + rank)
    expected = {}
    for it in range(ITERATIONS):
        x = torch.randn(4, 8, generator=gen)
        scale = scaler.get_scale()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ddp(x).float().pow(2).mean()
            ref_loss = reference(x).float().pow(2).mean()
        if it == OVERFLOW and rank == 0:  # one rank overflows; the reduced gradients carry it to both
            loss = loss * math.inf
        scaler.scale(loss).backward()
        (ref_loss * scale).backward()  # this rank's own gradient, scaled as autograd sees it in DDP
        for n, p in reference.named_parameters():
            expected[(n, it)] = ref_stats(p.grad)
            p.grad = None
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        with torch.no_grad():  # follow the model (the skipped step leaves it as it was)
            for p, q in zip(model.parameters(), reference.parameters()):
                q.copy_(p)
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert scaler.get_scale() < 2.0**10
    rows = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    assert {s for _, s, _ in rows} == set(range(ITERATIONS))
    for (n, s, _m), row in rows.items():
        assert row["skipped"] == ("1" if s == OVERFLOW else "")
        if s == OVERFLOW and rank == 0:
            assert float(row["nans"]) + float(row["infs"]) > 0
        else:  # the loss scale is in it: grad_unreduced is taken in backward, before unscaling
            assert_row_matches(row, expected[(n, s)], OPS)
    dist.barrier()
    return len(rows)


def test_gradscaler_overflow_under_ddp(tmp_path):
    from tests.distributed import run_ranks

    counts = run_ranks(_ddp_scaler, world_size=2, out_root=str(tmp_path))
    assert counts[0] == counts[1] > 0
