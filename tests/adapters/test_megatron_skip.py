"""Megatron's own skipped update (Inf gradients under a loss scale: `optimizer.step()` returns
update_successful=False) is its own step, flagged in the CSV's `skipped` column, with its gradients written
and the next step not shifted. bf16 with a constant loss scale (Float16OptimizerWithFloat16Params checks
for Inf whenever it has a scaler), 2 gloo ranks, real megatron-core under the test-only CUDA shim."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from tests.distributed import run_ranks
from tests.helpers import keyed, read_family

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

STEPS, OVERFLOW = 3, 1


def _case(rank: int, world: int, out_root: str) -> dict:
    import torch
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.adapters.test_megatron import _chunks, _setup_megatron
    from trainermon import TrainerMon

    _setup_megatron()
    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, f"rank{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "xy_distribution": True, "ops": ["norm", "nans", "infs"]}, fh)
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    ddps = [
        DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), Float16Module(config, m)
        )
        for m in _chunks(config)
    ]
    for ddp in ddps:
        ddp.broadcast_params()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, bf16=True, loss_scale=4.0), ddps)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(ddps, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(7 + rank)
    oks = []
    for step in range(STEPS):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddps[1](ddps[0](torch.randn(4, 6, generator=gen).bfloat16())).float().pow(2).mean() * 4.0
        if step == OVERFLOW:
            loss = loss * math.inf
        loss.backward()
        finalize_model_grads(ddps)
        oks.append(bool(opt.step()[0]))
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert oks == [s != OVERFLOW for s in range(STEPS)]  # Megatron really skipped the overflow step
    unreduced = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    assert {s for _, s, _ in unreduced} == set(range(STEPS))
    flags = {s: {r["skipped"] for (_, t, _), r in unreduced.items() if t == s} for s in range(STEPS)}
    assert flags == {s: {"1" if s == OVERFLOW else "0"} for s in range(STEPS)}, flags
    bad = [r for (_, s, _), r in unreduced.items() if s == OVERFLOW]
    assert any(float(r["nans"]) + float(r["infs"]) > 0 for r in bad)  # the overflow's own gradients
    actv = keyed(read_family(monitor.run_dir, "actv"))
    assert {s for _, s, _ in actv} == set(range(STEPS)) and {m for _, _, m in actv} == {0}  # nothing merged
    return len(unreduced)


def test_megatron_skipped_update_is_its_own_flagged_step(tmp_path):
    counts = run_ranks(_case, world_size=2, out_root=str(tmp_path))
    assert counts[0] == counts[1] > 0
